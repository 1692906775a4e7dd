"""GGUF in: an RWKV-7 GGUF (llama.cpp's "rwkv7", as its converter or
``rwkvx-c export --format gguf`` writes it) as a source of ``--init-from``.

GgufWeights reads the file through the gguf package's reader, which maps
it: nothing is read until the model asks for a tensor, and a tensor's
pages are dropped once it is copied (release), so the file is never held
whole. A matrix the file holds in the frozen base's own form (BF16 bits,
Q8_0, Q4_0 or Q4_K blocks: rows of W^T, as the base stores them) is handed over
as those bytes (raw_t, raw_blocks) and copied in as it is; any other form
is decoded with gguf's own dequantize, exactly, and encoded once into the
base (rwkvx_c.train.base says so in one line). A tensor the file holds in
float32 is no base's: it stays float32 (compact). The sizes come from the
metadata and the shapes, the tokenizer from tokenizer.ggml.* (the 256 byte
tokens, or the RWKV World vocabulary, every id checked against the rwkv
package's). docs/interop.md has the tensor table.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from rwkvx_c import _core
from rwkvx_c.data.tokenizers import WORLD_VOCAB_SIZE
from rwkvx_c.errors import InteropError
from rwkvx_c.interop.gguf import ARCH, STAND_INS, gguf_pairs, gguf_vocab, need_gguf
from rwkvx_c.interop.rwkv7 import PairedWeights
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.util.files import drop_pages

__all__ = ["GgufWeights", "ggml_dtype"]

# the ggml types named as the frozen base and --dtype name them
_NAMES = {"F32": "fp32", "F16": "fp16", "BF16": "bf16", "Q8_0": "q8_0", "Q4_0": "q4_0",
          "Q4_K": "q4_k"}
# the bytes of fp16 scales a block of each GGUF type the base holds starts with
_SCALE_BYTES = {"q8_0": 2, "q4_0": 2, "q4_k": 4}


def ggml_dtype(type_name: str) -> str:
    """Our name of a ggml tensor type (fp32, fp16, bf16, q8_0, q4_0, q4_k;
    any other lower-cased: q6_k ...)."""
    return _NAMES.get(type_name, type_name.lower())


def _field(r: Any, key: str, path: str) -> Any:
    f = r.fields.get(key)
    if f is None:
        raise InteropError(f"{path}: the GGUF metadata has no {key}")
    return f.contents()


class GgufWeights(PairedWeights):
    """An rwkv7 GGUF's weights under our parameter names, each read when
    asked for (float32, our orientation; see the module doc). config: the
    model's; tokenizer: "byte" or "world"; types: each parameter's form in
    the file (ggml_dtype); dtype: the frozen base --base-dtype auto gives
    (the form of most of the matrices' values: bf16, q8_0, q4_0, q4_k (a
    Q4_K_M file's, its Q6_K matrices converted once); fp16
    becomes bf16 and another quantized form q8_0, each converted once;
    fp32: no base)."""

    def __init__(self, path: str) -> None:
        gguf = need_gguf()
        try:
            r = gguf.GGUFReader(path)
        except (ValueError, KeyError, IndexError, OSError) as e:
            raise InteropError(f"{path}: not a GGUF file the gguf package reads ({e})") from None
        self._r, self.path = r, path
        arch = _field(r, "general.architecture", path)
        if arch != ARCH:
            raise InteropError(f"{path}: a GGUF of architecture {arch!r}; rwkvx_c reads "
                               f"RWKV-7 ({ARCH!r})")
        self._t = {t.name: t for t in r.tensors}
        self.config: dict[str, Any] = self._config()
        pairs = gguf_pairs(self.config)
        self._pairs = {ours: (theirs, how) for ours, theirs, how in pairs}
        extra = sorted(set(self._t) - {t for _, t, _ in pairs} - set(STAND_INS))
        if extra:
            raise InteropError(f"{path}: {extra[0]} is not a tensor of the RWKV-7 model rwkvx_c "
                               f"holds ({len(extra)} such)")
        self._shapes = {n: tuple(a.shape) for n, a in
                        _core.RxPtModel(dict(self.config), init=False).params.items()}
        for ours, (theirs, how) in self._pairs.items():
            if theirs not in self._t:
                raise InteropError(f"{path}: not a whole rwkv7 GGUF: {theirs} is missing")
            want = self._shapes[ours]
            want = want[::-1] if how == "t" else (6, 1, 1) + want if how.startswith("lerp") \
                else want
            got = tuple(int(d) for d in reversed(self._t[theirs].shape.tolist()))
            if got != want:
                raise InteropError(f"{path}: {theirs} has shape {got}, expected {want}")
        self.types = {ours: ggml_dtype(self._t[t].tensor_type.name)
                      for ours, (t, _) in self._pairs.items()}
        self.dtype = self._base_dtype()
        self.tokenizer = self._tokenizer()

    def _config(self) -> dict[str, Any]:
        keys = ("embedding_length", "block_count", "wkv.head_size", "feed_forward_length",
                "attention.decay_lora_rank", "attention.iclr_lora_rank",
                "attention.value_residual_mix_lora_rank", "attention.gate_lora_rank",
                "attention.layer_norm_epsilon")
        got = [_field(self._r, f"{ARCH}.{k}", self.path) for k in keys]   # each there
        try:
            C, L, N, F, *ranks = (int(v) for v in got[:-1])
            eps = float(got[-1])
        except (TypeError, ValueError):
            raise InteropError(f"{self.path}: its rwkv7 sizes are not numbers") from None
        emb = self._t.get("token_embd.weight")
        if emb is None or len(emb.shape) != 2 or int(emb.shape[0]) != C or N <= 0 or C % N:
            raise InteropError(f"{self.path}: no token_embd.weight of width {C} in heads of {N}")
        config: dict[str, Any] = dict(
            n_embd=C, n_head=C // N, head_size=N, n_rwkv_layer=L, n_attn_layer=0,
            vocab_size=int(emb.shape[1]), ffn_dim=F, Dw=ranks[0], Da=ranks[1], Dv=ranks[2],
            Dg=ranks[3], chunk_size=32, moba_top_k=2, ln0=1)
        if np.float32(eps) != np.float32(ModelConfig.default("ln_eps")):   # GGUF: a float32
            config["ln_eps"] = eps
        try:
            ModelConfig.from_dict(dict(config))
        except ValueError as e:
            raise InteropError(f"{self.path}: its sizes make no valid model: {e}") from None
        return config

    def _base_dtype(self) -> str:
        count: dict[str, int] = {}
        for ours, (_, how) in self._pairs.items():
            if how == "t" or ours == "emb":
                d = self.types[ours]
                count[d] = count.get(d, 0) + int(np.prod(self._shapes[ours]))
        top = max(count, key=lambda d: count[d])
        return top if top in ("fp32", "bf16", *_SCALE_BYTES) else \
            "bf16" if top == "fp16" else "q8_0"

    def _tokenizer(self) -> str:
        r, V = self._r, self.config["vocab_size"]
        model = r.fields.get("tokenizer.ggml.model")
        toks = r.fields.get("tokenizer.ggml.tokens")
        if model is None or toks is None or model.contents() != "rwkv" or len(toks.data) != V:
            raise InteropError(f"{self.path}: no rwkv tokenizer of {V} tokens in its metadata")
        if V not in (256, WORLD_VOCAB_SIZE):
            raise InteropError(f"{self.path}: a vocabulary of {V} tokens; rwkvx_c reads the 256 "
                               f"byte tokens or the {WORLD_VOCAB_SIZE}-token World vocabulary")
        want = gguf_vocab(V)[0]
        for i, j in enumerate(toks.data):
            got = bytes(toks.parts[j]).decode("utf-8", "replace")
            if got != want[i] and not (want[i].startswith("[PAD") and got.startswith("[PAD")):
                raise InteropError(f"{self.path}: token {i} is {got!r}, not the "
                                   f"{'byte' if V == 256 else 'World'} vocabulary's "
                                   f"{want[i]!r}")
        return "byte" if V == 256 else "world"

    # ---- Mapping -----------------------------------------------------------

    def __getitem__(self, name: str) -> np.ndarray:
        theirs, how = self._pairs[name]
        t = self._t[theirs]
        kind = t.tensor_type.name
        if kind == "F32":
            a = np.array(t.data, dtype=np.float32)
        elif kind == "F16":
            a = t.data.astype(np.float32)
        elif kind == "BF16":
            a = np.empty(t.data.shape[:-1] + (t.data.shape[-1] // 2,), np.float32)
            bits = a.view(np.uint32)
            bits[...] = t.data.view(np.uint16)
            bits <<= 16
        else:
            try:
                a = need_gguf().quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            except NotImplementedError:
                raise InteropError(f"{self.path}: {theirs} is {kind}, which the gguf package "
                                   "cannot dequantize") from None
        self.release(name)
        if not np.isfinite(a).all():
            raise InteropError(f"{self.path}: {theirs} holds a non-finite value")
        if how == "t":
            return np.ascontiguousarray(a.reshape(self._shapes[name][::-1]).T)
        if how.startswith("lerp"):
            return np.ascontiguousarray(a.reshape(6, -1)[int(how[4:])])
        return a.reshape(self._shapes[name])

    def compact(self, name: str) -> bool:
        """Whether the file holds name in less than float32 (a base may hold it)."""
        return self.types[name] != "fp32"

    def _matrix(self, name: str) -> Any:
        theirs, how = self._pairs[name]
        return self._t[theirs] if how == "t" or name == "emb" else None

    def raw_t(self, name: str) -> np.ndarray | None:
        """A BF16 matrix's bits as the file holds them, [out, in] (the
        embedding's [vocab, C]); None for any other."""
        t = self._matrix(name)
        return None if t is None or self.types[name] != "bf16" else t.data.view(np.uint16)

    def raw_blocks(self, name: str) -> tuple[str, np.ndarray] | None:
        """(q8_0, q4_0 or q4_k, the file's blocks: uint8 rows of W^T [out,
        in / block values * block bytes]) of a matrix the file holds so,
        every block's scales (q4_k: d and dmin) finite; None for any other."""
        t = self._matrix(name)
        d = self.types[name]
        if t is None or d not in _SCALE_BYTES:
            return None
        _, nbytes = _core.base_dtype_block(d)
        scales = t.data.reshape(-1, nbytes)[:, :_SCALE_BYTES[d]].copy().view(np.float16)
        if not np.isfinite(scales).all():
            raise InteropError(f"{self.path}: {self._pairs[name][0]} has a non-finite block "
                               "scale")
        return d, t.data

    def release(self, name: str) -> None:
        """Drop the mapped pages of name's tensor (read again if asked again)."""
        t = self._t[self._pairs[name][0]]
        m = getattr(self._r.data, "_mmap", None)
        if m is None or not t.n_bytes:
            return
        drop_pages(m, t.data_offset, t.data_offset + t.n_bytes)
