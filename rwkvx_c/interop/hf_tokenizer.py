"""The tokenizer files of a Hugging Face folder: those an export writes
(save_tokenizer: World's vocabulary and entry point, the byte vocabulary
as a tokenizer.json, or a run's own tokenizer.json; each declaring id 0 its
end-of-text) and the tokenizer an import reads back (hf_tokenizer); with
the copy of the folder's modeling files (write_code) and its JSON files
(write_json), each written atomically. rwkvx_c.interop.hf re-exports the
public names.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from typing import Any

from rwkvx_c.data.tokenizers import (
    WORLD_VOCAB,
    WORLD_VOCAB_SIZE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    WorldTokenizer,
    _byte_level_table,
    world_vocab_path,
)
from rwkvx_c.errors import InteropError, TokenizerError
from rwkvx_c.util.atomic import replace_with, replacing
from rwkvx_c.util.files import read_json

__all__ = ["EOT_ID", "BYTE_MARK", "WORLD_CODE", "write_code", "write_json", "save_tokenizer",
           "hf_tokenizer"]

WORLD_CODE = ("tokenization_rwkv7.py",)   # World's tokenizer entry point (hf_code/)
# the end-of-text token every exported vocabulary declares: id 0, the separator
# rwkvx_c trains between documents (rwkvx_c.data.chat.SEPARATOR)
EOT_ID = 0
WORLD_EOT, WORLD_PAD = "<|endoftext|>", "<|padding|>"   # rwkv7-hf's names for id 0
# tokenizer_config.json key saying the folder's tokenizer.json is rwkvx_c's byte vocabulary
BYTE_MARK = "rwkvx_c_tokenizer"
_CODE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_code")


def write_code(names: tuple[str, ...], out_dir: str) -> None:
    """Copies the modeling files `names` (package data, rwkvx_c/interop/hf_code/)
    into out_dir, each atomically."""
    for name in names:
        replace_with(os.path.join(out_dir, name),
                     functools.partial(shutil.copyfile, os.path.join(_CODE_DIR, name)))


def write_json(path: str, obj: Any) -> None:
    with replacing(path, "w") as f:
        f.write(json.dumps(obj, indent=2) + "\n")


def save_tokenizer(tok: Tokenizer, out_dir: str, vocab: int,
                   chat_template: str | None = None) -> None:
    """The tokenizer files AutoTokenizer.from_pretrained(DIR,
    trust_remote_code=True) loads, each declaring id 0 its end-of-text
    token (eos_token), so generate and lm-eval's generate_until stop there:
    World, the vocabulary file rwkv7-hf's RWKV7Tokenizer reads and its entry
    point (id 0 is its <|endoftext|>); bytes, a tokenizer.json whose byte 0
    is a special token (PreTrainedTokenizerFast); a tokenizer.json run, its
    own file with its id-0 token declared. chat_template: the Jinja
    template apply_chat_template renders (the run's, rwkvx_c.data.templates)."""
    tc: dict[str, Any] = {"model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        tc["chat_template"] = chat_template
    if tok.name == "world":
        src = world_vocab_path()
        dst = os.path.join(out_dir, os.path.basename(src))
        replace_with(dst, lambda tmp: shutil.copyfile(src, tmp))
        write_code(WORLD_CODE, out_dir)
        tc.update(tokenizer_class="RWKV7Tokenizer", model_vocab_size=vocab,
                  auto_map={"AutoTokenizer": ["tokenization_rwkv7.RWKV7Tokenizer", None]},
                  eos_token=WORLD_EOT, pad_token=WORLD_PAD, errors="replace")
    elif tok.name == "byte":
        eot = _write_byte_tokenizer(os.path.join(out_dir, "tokenizer.json"))
        tc.update(tokenizer_class="PreTrainedTokenizerFast", eos_token=eot, pad_token=eot,
                  **{BYTE_MARK: "byte"})
    else:
        tok.save(out_dir)   # the run's own tokenizer.json
        eot = _id0_token(os.path.join(out_dir, "tokenizer.json"))
        tc.update(tokenizer_class="PreTrainedTokenizerFast", eos_token=eot, pad_token=eot)
    write_json(os.path.join(out_dir, "tokenizer_config.json"), tc)
    write_json(os.path.join(out_dir, "special_tokens_map.json"),
                {"eos_token": tc["eos_token"], "pad_token": tc["pad_token"]})


def _id0_token(path: str) -> str:
    """The token string of id 0 in a tokenizer.json (a run's tokenizer
    loaded it, so the package is there)."""
    import tokenizers
    text = tokenizers.Tokenizer.from_file(path).id_to_token(EOT_ID)
    if text is None:
        raise InteropError(f"{path} has no token of id {EOT_ID}, the end-of-text")
    return str(text)


def _write_byte_tokenizer(path: str) -> str:
    """The byte vocabulary (id = byte value) as a tokenizer.json: a BPE with
    no merges over the byte-level alphabet, so every byte is its own token.
    The byte-level mapping is the normaliser, and byte 0, the end-of-text,
    is a special token spelt as the NUL character itself and matched in the
    raw text: only a NUL byte is id 0 (not the character byte-level BPE
    spells byte 0 with), and it decodes back to NUL. Returns its text."""
    try:
        import tokenizers
        from tokenizers import AddedToken, decoders, models, normalizers
    except ImportError:
        raise InteropError("the byte tokenizer's tokenizer.json needs the tokenizers "
                           'package: pip install "rwkvx_c[hf]"') from None
    eot = bytes([EOT_ID]).decode("latin-1")
    vocab = {t: i for t, i in _byte_level_table().items() if i != EOT_ID}
    vocab[eot] = EOT_ID
    t = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.normalizer = normalizers.ByteLevel()
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken(eot, special=True, normalized=False)])
    replace_with(path, lambda tmp: t.save(tmp))
    return eot


def hf_tokenizer(folder: str, vocab: int) -> Tokenizer:
    """The tokenizer of an HF folder: rwkvx_c's byte vocabulary (marked in
    tokenizer_config.json), World for a 65,536-id model with the World
    vocabulary file or without a tokenizer.json (fla-hub and rwkv7-hf World
    models), else its tokenizer.json."""
    tc: object = {}
    with contextlib.suppress(OSError, InteropError):   # without one: not the byte mark
        tc = read_json(os.path.join(folder, "tokenizer_config.json"), InteropError,
                       "the tokenizer config")
    tj = os.path.join(folder, "tokenizer.json")
    tok: Tokenizer
    world = vocab == WORLD_VOCAB_SIZE and os.path.isfile(os.path.join(folder, WORLD_VOCAB))
    if isinstance(tc, dict) and tc.get(BYTE_MARK) == "byte":
        tok = ByteTokenizer()
    elif os.path.isfile(tj) and not world:
        try:
            tok = HFTokenizer(tj)
        except TokenizerError as e:
            raise InteropError(str(e)) from None
    elif vocab == WORLD_VOCAB_SIZE:
        try:
            tok = WorldTokenizer()
        except TokenizerError as e:
            raise InteropError(str(e)) from None
    elif vocab == 256:
        tok = ByteTokenizer()
    else:
        raise InteropError(f"{folder} has no tokenizer.json and its {vocab}-id vocabulary is "
                           "neither bytes nor World")
    if tok.vocab_size > vocab:
        raise InteropError(f"{folder}: its tokenizer has {tok.vocab_size} ids, more than the "
                           f"model's {vocab}")
    return tok
