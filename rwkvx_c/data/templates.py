"""Chat templates: how a conversation becomes the text a model reads
(docs/finetune.md §Chat templates).

Every template is a Jinja template rendered as transformers renders a
tokenizer's ``chat_template`` (``apply_chat_template``): a sandboxed
environment with trim_blocks and lstrip_blocks, the loopcontrols extension,
``raise_exception``, ``strftime_now`` and a ``tojson`` that leaves non-ASCII
text as it is, given ``messages`` (``[{"role", "content"}]``),
``add_generation_prompt`` and the special tokens the HF export declares
(``eos_token`` and ``pad_token``: the vocabulary's id 0). So a run's export
carries its template text and ``tokenizer.apply_chat_template`` writes what
the run trained on. Three sources (``--chat-template``):

- ``rwkv`` (the default): RWKV's ``System: / User: / Assistant:`` turns, each
  closed by a blank line, the content's newlines collapsed as the ``rwkv``
  package's API_DEMO_CHAT prepares a message (rwkvx_c.data.chat);
- ``chatml``: ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n``;
- ``tokenizer``: the ``chat_template`` of the tokenizer_config.json beside the
  run's --tokenizer tokenizer.json; or a PATH: a Jinja file, a
  tokenizer_config.json or a folder holding one (or chat_template.jinja).

What is trained is found by rendering prefixes: an assistant turn's text is
what the conversation up to it adds over the conversation before it with
the generation prompt (``add_generation_prompt``), so a template must render
earlier turns the same whatever follows them (one that rewrites them, such
as dropping earlier reasoning, is refused with a DataError).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from rwkvx_c.errors import DataError

if TYPE_CHECKING:
    from rwkvx_c.data.tokenizers import Tokenizer

__all__ = ["BUILTIN", "DEFAULT_TEMPLATE", "TEMPLATE_CHOICES", "ChatTemplate", "load_template",
           "builtin", "end_of_text"]

# RWKV's turns; a message's content is prepared as rwkvx_c.data.chat.normalise
# does (line ends made \n, runs of newlines made one, the ends stripped)
RWKV = (
    "{%- set names = {'system': 'System', 'user': 'User', 'assistant': 'Assistant'} -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] not in names -%}"
    "{{ raise_exception('roles are system, user and assistant, not ' + message['role']) }}"
    "{%- endif -%}\n"
    "{%- set content = message['content'].replace('\\r\\n', '\\n').replace('\\r', '\\n')"
    ".split('\\n') | reject('equalto', '') | join('\\n') | trim -%}\n"
    "{{ names[message['role']] + ': ' + content + '\\n\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}\n")
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
BUILTIN = {"rwkv": RWKV, "chatml": CHATML}
DEFAULT_TEMPLATE = "rwkv"
TEMPLATE_CHOICES = "rwkv|chatml|tokenizer|PATH"
JINJA_FILE = "chat_template.jinja"   # transformers' file of a folder's template
_PROBE = "\ue000PROBE\ue001"         # a reply no template alters (private-use characters)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    """The template compiled in transformers' environment (its
    _compile_jinja_template, less the {% generation %} tracker)."""
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError('chat templates need jinja2: pip install "jinja2>=3.1.6"') from None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise DataError(f"the chat template does not parse: {e}") from None


class ChatTemplate:
    """A chat template: name ("rwkv", "chatml", or where it was read from),
    source (its Jinja text) and the special tokens it is rendered with."""

    def __init__(self, name: str, source: str, eos_token: str | None = None) -> None:
        self.name, self.source, self.eos_token = name, source, eos_token
        self._template = _compile(source)
        self.stops = self._stops()

    def stored(self) -> dict[str, str | None]:
        """What a checkpoint keeps of the template (from_stored reads it back)."""
        return {"name": self.name, "source": self.source, "eos_token": self.eos_token}

    @classmethod
    def from_stored(cls, d: object) -> ChatTemplate:
        """The template a checkpoint's state holds; RWKV's for a run without one."""
        if not isinstance(d, dict) or not isinstance(d.get("source"), str):
            return builtin()
        eos = d.get("eos_token")
        return cls(str(d.get("name") or "template"), d["source"],
                   eos if isinstance(eos, str) else None)

    def identity(self) -> str:
        """What a token cache keys on: the text and tokens it renders with."""
        return hashlib.sha256(json.dumps([self.source, self.eos_token]).encode()).hexdigest()

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False
               ) -> str:
        """The text of messages, as apply_chat_template(tokenize=False) gives it."""
        import jinja2
        special = {"eos_token": self.eos_token, "pad_token": self.eos_token} \
            if self.eos_token is not None else {}
        try:
            return str(self._template.render(messages=list(messages), tools=None,
                                             documents=None,
                                             add_generation_prompt=add_generation_prompt,
                                             **special))
        except jinja2.exceptions.TemplateError as e:
            raise DataError(f"chat template {self.name}: {e}") from None

    def segments(self, messages: Sequence[dict[str, str]], where: str,
                 train_on_inputs: bool = False) -> list[tuple[str, bool]]:
        """The (text, trained) pieces of a conversation: each assistant turn
        (the text it adds after the generation prompt) trained, the rest not
        (all of it with train_on_inputs). DataError naming `where` when the
        template renders a prefix differently once more turns follow."""
        out: list[tuple[str, bool]] = []
        done = ""   # the text covered by out
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            full = self.render(messages[: i + 1])
            if not prompt.startswith(done) or not full.startswith(prompt):
                raise DataError(f"{where}: chat template {self.name} renders the turns before "
                                f"message {i} differently once it follows, so its replies "
                                "cannot be cut out; use a template that renders a "
                                "conversation's start the same whatever follows")
            if len(prompt) > len(done):
                out.append((prompt[len(done):], train_on_inputs))
            out.append((full[len(prompt):], True))
            done = full
        whole = self.render(messages)
        if not whole.startswith(done):
            raise DataError(f"{where}: chat template {self.name} renders the conversation's "
                            "start differently once later turns follow")
        if len(whole) > len(done):   # turns after the last reply: context, no target
            out.append((whole[len(done):], train_on_inputs))
        return out

    def _stops(self) -> tuple[str, ...]:
        """The text that ends a reply: what the template writes after an
        assistant turn's content (its whitespace stripped when more is
        left: "<|im_end|>" of "<|im_end|>\\n"; RWKV's blank line as is).
        Sets lead: what it writes between the generation prompt and the
        content (RWKV's space after "Assistant:"), which a reply begins with."""
        self.lead = ""
        msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
        try:
            prompt = self.render(msgs[:1], add_generation_prompt=True)
            text = self.render(msgs)
        except DataError:
            return ()
        if _PROBE not in text:
            return ()
        before, end = text.split(_PROBE, 1)
        if before.startswith(prompt):
            self.lead = before[len(prompt):]
        return (end.strip() or end,) if end else ()


def builtin(name: str = DEFAULT_TEMPLATE) -> ChatTemplate:
    return ChatTemplate(name, BUILTIN[name])


def end_of_text(tok: Tokenizer) -> str | None:
    """The text of id 0, the end-of-text every HF export declares its
    eos_token and pad_token (rwkvx_c.interop.hf_tokenizer), so a template's
    {{ eos_token }} renders the same in training and in the export."""
    if tok.name == "byte":
        return "\x00"
    if tok.name == "world":
        return "<|endoftext|>"
    inner = getattr(tok, "_tok", None)
    text = inner.id_to_token(0) if inner is not None else None
    return str(text) if text is not None else None


def _config_template(path: str) -> str:
    """The chat_template of a tokenizer_config.json (or chat_template.jinja beside it)."""
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read the chat template of {path}: {e}") from None
    t = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if isinstance(t, list):   # named templates: the default one
        t = next((x.get("template") for x in t if isinstance(x, dict)
                  and x.get("name") == "default"), None)
    if not isinstance(t, str) or not t:
        jinja = os.path.join(os.path.dirname(path), JINJA_FILE)
        if os.path.isfile(jinja):
            return _read(jinja)
        raise DataError(f"{path} has no chat_template")
    return t


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read the chat template {path}: {e}") from None


def load_template(spec: str | None, tokenizer: str | None = None,
                  eos_token: str | None = None) -> ChatTemplate:
    """The template --chat-template names: rwkv, chatml, tokenizer (the
    tokenizer_config.json beside the tokenizer.json `tokenizer`), a Jinja
    file, a tokenizer_config.json or a folder with one. eos_token: the
    end-of-text the export declares (rendered for {{ eos_token }})."""
    spec = spec or DEFAULT_TEMPLATE
    if spec in BUILTIN:
        return ChatTemplate(spec, BUILTIN[spec], eos_token)
    if spec == "tokenizer":
        if not tokenizer or not tokenizer.endswith(".json") or not os.path.isfile(tokenizer):
            raise DataError("--chat-template tokenizer reads the tokenizer_config.json beside "
                            "a --tokenizer tokenizer.json; give its path or a template file")
        path = os.path.join(os.path.dirname(os.path.abspath(tokenizer)),
                            "tokenizer_config.json")
        if not os.path.isfile(path):
            raise DataError(f"--chat-template tokenizer: no {path} beside {tokenizer}")
        return ChatTemplate(path, _config_template(path), eos_token)
    if os.path.isdir(spec):
        jinja = os.path.join(spec, JINJA_FILE)
        cfg = os.path.join(spec, "tokenizer_config.json")
        if os.path.isfile(jinja):
            return ChatTemplate(jinja, _read(jinja), eos_token)
        if os.path.isfile(cfg):
            return ChatTemplate(cfg, _config_template(cfg), eos_token)
        raise DataError(f"{spec} holds neither {JINJA_FILE} nor a tokenizer_config.json")
    if not os.path.isfile(spec):
        raise DataError(f"--chat-template {spec!r} is neither {', '.join(BUILTIN)}, tokenizer "
                        "nor a file")
    if spec.endswith(".json"):
        return ChatTemplate(spec, _config_template(spec), eos_token)
    return ChatTemplate(spec, _read(spec), eos_token)
