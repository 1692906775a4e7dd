"""Chat templates (docs/finetune.md §Chat templates): RWKV's, ChatML and a
tokenizer's own Jinja chat_template, chosen by --chat-template on the
command line, in TrainOptions and in a config file; the tokens a run
trains on equal transformers' apply_chat_template of its HF export token
for token (with and without the generation prompt); --train-on-inputs;
chat and the stored template; templates that cannot be cut into turns."""
import json
import os

import numpy as np
import pytest
from test_train import SMALL

from rwkvx_c.cli import main
from rwkvx_c.data.chat import ChatFormat, encode_chat, segments
from rwkvx_c.data.sources import source_files
from rwkvx_c.data.templates import CHATML, RWKV, ChatTemplate, builtin, load_template
from rwkvx_c.data.tokenizers import load as load_tokenizer
from rwkvx_c.errors import DataError
from rwkvx_c.run.checkpoint import read_state
from rwkvx_c.sample import Chat, Sampling, load_run, run_template
from rwkvx_c.train import Trainer, TrainOptions

HERE = os.path.dirname(__file__)
CHAT = os.path.join(HERE, "data", "chat.jsonl")
RWKV_MODEL = dict(SMALL, n_attn_layer=0)
# a Llama-2-like template: no generation prompt, the reply after " "
INST = ("{% for message in messages %}{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'system' %}{{ '<<SYS>>\\n' + message['content'] + "
        "'\\n<</SYS>>\\n\\n' }}{% else %}{{ ' ' + message['content'] + '\\n' }}{% endif %}"
        "{% endfor %}")
CONV = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Because."}]


def _records():
    with open(CHAT, encoding="utf-8") as f:
        return [json.loads(x) for x in f if x.strip()]


def test_rwkv_template_is_the_rwkv_rendering_and_chatml_is_chatml():
    segs = segments({"messages": CONV}, "r")
    assert segs == [("System: Be terse.\n\nUser: Hi there\n\nAssistant:", False),
                    (" Hello.\n\n", True), ("User: Why?\n\nAssistant:", False),
                    (" Because.\n\n", True)]
    # RWKV's preparation of a message, in the Jinja template itself
    assert builtin().render([{"role": "user", "content": "\r\n a\n\n\nb \n"}]) == \
        "User: a\nb\n\n"
    c = segments({"messages": CONV}, "r", builtin("chatml"))
    assert c[1] == ("Hello.<|im_end|>\n", True)
    assert c[0][0].endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert builtin("chatml").stops == ("<|im_end|>",) and builtin().stops == ("\n\n",)
    assert builtin().lead == " " and builtin("chatml").lead == ""


def test_transformers_renders_the_same_text():
    transformers = pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template
    assert transformers
    for source in (RWKV, CHATML, INST):
        t = ChatTemplate("t", source)
        for gen in (False, True):
            want = render_jinja_template([CONV], chat_template=source,
                                         add_generation_prompt=gen)[0][0]
            assert t.render(CONV, gen) == want


def test_train_on_inputs_trains_every_token_but_a_conversations_first(tmp_path):
    tok = load_tokenizer("byte")
    got = {}
    for inputs in (False, True):
        got[inputs] = out = []
        encode_chat(source_files([CHAT])[0], tok, lambda ids, m, out=out: out.append((ids, m)),
                    chat=ChatFormat(builtin("chatml"), inputs))
    for (ids, m0), (ids1, m1) in zip(got[False], got[True]):
        assert np.array_equal(ids, ids1)
        assert m1[0] == 0 and m1[-1] == 0 and m1[1:-1].all()
        assert m0.sum() < m1.sum()


def test_a_template_that_rewrites_earlier_turns_is_refused():
    # drops every assistant turn but the last, as reasoning templates drop thoughts
    src = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
           "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(DataError, match="differently"):
        ChatTemplate("odd", src).segments(CONV, "f.jsonl:3")
    with pytest.raises(DataError, match="does not parse"):
        ChatTemplate("bad", "{% for %}")
    with pytest.raises(DataError, match="neither"):
        load_template("no-such-template")
    with pytest.raises(DataError, match=r"tokenizer_config\.json"):
        load_template("tokenizer", "byte")


def _bpe(tmp_path):
    """A tokenizer.json with a tokenizer_config.json beside it holding INST."""
    d = tmp_path / "tok"
    d.mkdir()
    text = tmp_path / "corpus.txt"
    text.write_text("".join(ChatTemplate("t", INST).render(r["messages"]) * 3
                            for r in _records() if "messages" in r))
    assert main(["tokenizer", "train", str(text), "--vocab-size", "320",
                 "--out", str(d / "tokenizer.json")]) == 0
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": INST}))
    return str(d / "tokenizer.json")


def _train(tmp_path, route, template, tokenizer="byte"):
    out = str(tmp_path / f"run-{route}")
    common = dict(steps=1, seq_len=32, batch=2, eval_tokens=64, threads=1, precision="fp32",
                  cache_dir=str(tmp_path / "cache"))
    if route == "cli":
        assert main(["train", "--preset", "tiny", "--n-attn-layer", "0", "--data", CHAT,
                     "--out", out, "--chat-template", template, "--tokenizer", tokenizer]
                    + [f"--{k.replace('_', '-')}={v}" for k, v in common.items()]) == 0
    elif route == "options":
        Trainer(TrainOptions(preset="tiny", data=CHAT, model=dict(RWKV_MODEL),
                             chat_template=template, tokenizer=tokenizer, **common), out).run()
    else:
        cfg = tmp_path / "run.toml"
        cfg.write_text("\n".join([f'data = "{CHAT}"', f'chat_template = "{template}"',
                                  f'tokenizer = "{tokenizer}"', "[model]", "n_attn_layer = 0"])
                       + "\n")
        assert main(["train", "--preset", "tiny", "--config", str(cfg), "--out", out]
                    + [f"--{k.replace('_', '-')}={v}" for k, v in common.items()]) == 0
    return out


@pytest.mark.parametrize("route,template", [("cli", "chatml"), ("options", "rwkv"),
                                            ("config", "tokenizer")])
def test_the_hf_export_renders_the_trained_tokens(tmp_path, route, template, capsys):
    """Each template through one route: the run keeps its template, and the
    export's apply_chat_template gives the tokens it trained on."""
    pytest.importorskip("safetensors")
    transformers = pytest.importorskip("transformers")
    tokenizer = _bpe(tmp_path) if template == "tokenizer" else "byte"
    out = _train(tmp_path, route, template, tokenizer)
    t = run_template(out)
    want = {"chatml": CHATML, "rwkv": RWKV, "tokenizer": INST}[template]
    assert t.source == want
    assert read_state(os.path.join(out, "checkpoint.safetensors"))["options"].get(
        "chat_template", "rwkv") == template
    hf = str(tmp_path / "hf")
    assert main(["export", out, "--format", "hf", "--out", hf]) == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf)
    _, tok = load_run(out)
    trained = []
    encode_chat(source_files([CHAT])[0], tok, lambda ids, m: trained.append(ids),
                chat=ChatFormat(t))
    compared = 0
    for rec, ids in zip(_records(), trained):
        msgs = rec.get("messages")
        if msgs is None:
            continue
        compared += 1
        got = _ids(hf_tok.apply_chat_template(msgs, tokenize=True))
        assert got == [int(i) for i in ids[:-1]]   # the separator is the packing's
        prompt = _ids(hf_tok.apply_chat_template(msgs[:-1], tokenize=True,
                                                 add_generation_prompt=True))
        assert prompt == list(tok.encode(t.render(msgs[:-1], add_generation_prompt=True)))
    assert compared >= 3


def _ids(x):
    """apply_chat_template's ids, a list or (transformers 5) a BatchEncoding."""
    return list(x["input_ids"]) if hasattr(x, "keys") else list(x)


def test_chat_reads_the_conversation_as_the_template_renders_it(tmp_path):
    out = _train(tmp_path, "options", "chatml")
    model, tok = load_run(out, hold_base=True)
    c = Chat(model, tok, Sampling(temperature=0), 8, 4096, system="Be terse.",
             template=run_template(out))
    for line in ("Hi", "More"):
        "".join(c.say(line))
        assert c.transcript == builtin("chatml").render(c.messages)
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant", "user",
                                               "assistant"]


def test_a_template_without_chat_data_is_refused(tmp_path):
    from rwkvx_c.errors import TrainError
    with pytest.raises(TrainError, match="--chat-template"):
        TrainOptions(objective="dpo", chat_template="chatml").resolved()
    text = tmp_path / "t.txt"
    text.write_text("plain text " * 200)
    for kw in ({"chat_template": "chatml"}, {"train_on_inputs": True}):
        with pytest.raises(TrainError, match="plain text"):
            Trainer(TrainOptions(preset="tiny", data=str(text), model=dict(RWKV_MODEL),
                                 steps=1, seq_len=16, batch=2,
                                 cache_dir=str(tmp_path / "cache"), **kw),
                    str(tmp_path / "run"))


def test_eval_scores_a_chat_run_in_its_template(tmp_path, capsys):
    """eval RUN --split val renders the run's chat data with its template:
    the logged val_loss again."""
    out = _train(tmp_path, "options", "chatml")
    with open(os.path.join(out, "log.jsonl")) as f:
        last = [r for r in map(json.loads, f) if "val_loss" in r][-1]
    capsys.readouterr()
    assert main(["eval", out, "--split", "val", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["data"]
    assert got["loss"] == pytest.approx(last["val_loss"], rel=1e-6)


@pytest.mark.parametrize("name", ["rwkv", "chatml"])
def test_the_world_export_renders_the_trained_tokens(tmp_path, name):
    """The World vocabulary through rwkv7-hf's tokenizer: the ids a run
    trains on (each piece encoded alone) are apply_chat_template's."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("rwkv7_hf")
    from rwkvx_c.interop.hf_tokenizer import save_tokenizer
    try:
        tok = load_tokenizer("world")
    except Exception as e:  # noqa: BLE001 -- no rwkv package: no World vocabulary
        pytest.skip(str(e))
    t = builtin(name)
    save_tokenizer(tok, str(tmp_path), 65536, t.source)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), trust_remote_code=True)
    trained = []
    encode_chat(source_files([CHAT])[0], tok, lambda ids, m: trained.append(ids),
                chat=ChatFormat(t))
    msgs = [r.get("messages") for r in _records()]
    pairs = [(m, ids) for m, ids in zip(msgs, trained) if m is not None]
    assert len(pairs) >= 3
    for m, ids in pairs:
        assert _ids(hf.apply_chat_template(m, tokenize=True)) == [int(i) for i in ids[:-1]]
