"""Generation as users expect it (rwkvx_c.sample, docs/training.md
§Sampling): top-k and top-p, the rwkv package's repetition penalties and
banned / stop ids against its own PIPELINE, stop strings in generate() and
`sample --stop`, a long prompt in bounded pieces under an address-space
limit, and `rwkvx-c chat` (its state carried from turn to turn, its
replies stopped at the turn's end) driven through a pseudo-terminal."""
import os
import pty
import select
import subprocess
import sys
import time

import numpy as np
import pytest

import rwkvx_c as rx
import rwkvx_c.sample as smp
from rwkvx_c.cli import main
from rwkvx_c.data.chat import normalise
from rwkvx_c.errors import SampleError
from rwkvx_c.run.checkpoint import save_checkpoint
from rwkvx_c.run.rundir import CHECKPOINT
from rwkvx_c.sample import Chat, Sampling, Session, StopText, generate, sample_token

from hostile import env

HERE = os.path.dirname(os.path.abspath(__file__))
RWKV = dict(n_embd=32, n_head=2, head_size=16, n_rwkv_layer=2, n_attn_layer=0, vocab_size=256,
            ffn_dim=64, Dw=8, Da=8, Dg=8, Dv=8, chunk_size=8, moba_top_k=1)
HYBRID = dict(RWKV, n_attn_layer=1)
# the reply of the bigram model: after "Assistant:" it writes " OK." and
# then newlines for ever
BIGRAM = {":": " ", " ": "O", "O": "K", "K": ".", ".": "\n", "\n": "\n"}


def bigram_model():
    """A byte model whose next token depends on the last one alone (every
    block's output projection is zero, so the head reads LayerNorm(emb[t])),
    with argmax next(t) = BIGRAM[t]."""
    m = rx.RxPtModel(RWKV, seed=1)
    for n, p in m.params.items():
        if n.endswith(("tm.output_w", "cm.ffn_value_w")):
            p[...] = 0
    m.params["ln_out_w"][:] = 1
    m.params["ln_out_b"][:] = 0
    emb = m.params["emb"]
    z = (emb - emb.mean(1, keepdims=True)) / emb.std(1, keepdims=True)   # LayerNorm(emb)
    head = m.params["head"]          # [C, V]
    head[...] = 0
    for a, b in BIGRAM.items():
        head[:, ord(b)] += 4 * z[ord(a)]
    return m


def _save(model, folder):
    os.makedirs(folder, exist_ok=True)
    save_checkpoint(os.path.join(folder, CHECKPOINT), model.params, model.config, {})
    return folder


# ------------------------------------------------------------ the sampler


def test_sampling_is_checked():
    for kw, what in [({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"),
                     ({"top_k": -1}, "top_k"), ({"top_k": 1.5}, "top_k"),
                     ({"alpha_presence": float("nan")}, "alpha_presence"),
                     ({"alpha_decay": 2}, "alpha_decay"), ({"stop": ("",)}, "stop string"),
                     ({"token_ban": [-1]}, "token_ban"), ({"token_stop": ["a"]}, "token_stop")]:
        with pytest.raises(SampleError, match=what):
            Sampling(**kw)
    assert Sampling(stop="\n\n").stop == ("\n\n",)   # one string is one stop
    assert Sampling(stop=["a", "b"], token_ban=[np.int64(3)]).token_ban == (3,)
    with pytest.raises(SampleError, match="top_k"):
        list(generate(rx.RxPtModel(RWKV), "a", 2, top_k=-2))


def test_top_k_and_top_p():
    rng = np.random.default_rng(0)
    logits = np.array([0.0, 5.0, 4.0, 3.9, -10.0])
    assert {sample_token(logits, rng, 100.0, 1.0, top_k=1) for _ in range(50)} == {1}
    assert {sample_token(logits, rng, 100.0, 1.0, top_k=2) for _ in range(200)} == {1, 2}
    assert {sample_token(logits, rng, 100.0, 1.0, top_k=3) for _ in range(300)} == {1, 2, 3}
    # top-p over the top-k, renormalised: at a high temperature the two
    # kept are near equal, so 0.4 of the mass is the first alone
    assert {sample_token(logits, rng, 100.0, 0.4, top_k=2) for _ in range(50)} == {1}
    assert {sample_token(logits, rng, 100.0, 0.6, top_k=2) for _ in range(200)} == {1, 2}
    # the draw frequencies are the renormalised top-k softmax
    p = np.exp(logits[1:4] - 5.0)
    p /= p.sum()
    draws = np.bincount([sample_token(logits, rng, 1.0, 1.0, top_k=3) for _ in range(4000)],
                        minlength=5)
    assert draws[0] == draws[4] == 0
    assert np.allclose(draws[1:4] / 4000, p, atol=0.03)


def test_stop_text_holds_back_what_may_start_a_stop():
    s = StopText(["\n\nUser:", "END"])
    assert s.push("Hello") == "Hello"
    assert s.push(".\n") == "."          # "\n" may begin "\n\nUser:"
    assert s.push("\nUs") == ""
    assert s.push("e") == ""
    assert s.push("d it") == "\n\nUsed it" and not s.hit
    assert s.push(" EN") == " "
    assert s.push("Dless") == "" and s.hit
    s = StopText(["ab"])
    assert s.push("xa") == "x" and s.flush() == "a"


class _PipelineModel:
    """Our model behind the rwkv package's PIPELINE: forward(tokens, state)
    -> (logits of the last token as a torch tensor, state)."""

    def __init__(self, model):
        self.model = model

    def forward(self, tokens, state):
        import torch
        state = state or rx.InferState(self.model, max_len=1)
        logits = state.forward(np.asarray(tokens, np.int32))[-1]
        return torch.from_numpy(logits.copy()), state


def test_penalties_ban_and_stop_ids_are_the_rwkv_pipelines(monkeypatch):
    """Greedy generation with presence, frequency and decay penalties, a
    banned id and a stop id draws the ids the rwkv package's PIPELINE draws
    from the same logits (World vocabulary); without the penalties the ids
    differ, so the penalties are what is compared."""
    pytest.importorskip("torch")
    utils = pytest.importorskip("rwkv.utils")
    from rwkvx_c.data.tokenizers import load as load_tokenizer
    tok = load_tokenizer("world")
    model = rx.RxPtModel(dict(RWKV, vocab_size=tok.vocab_size), seed=5)
    # a few favoured ids, so that greedy generation repeats them (the rest
    # scaled down, never tied: a tie is a random draw in the pipeline)
    head = model.params["head"]
    favoured = np.random.default_rng(1).choice(np.arange(300, tok.vocab_size), 12, False)
    head *= 0.01
    head[:, favoured] *= 300
    prompt = "User: tell me about the sea\n\nAssistant:"
    ours = []
    real = sample_token
    monkeypatch.setattr(smp, "sample_token", lambda *a, **k: ours.append(real(*a, **k))
                        or ours[-1])
    kw = dict(alpha_presence=0.4, alpha_frequency=0.7, alpha_decay=0.9)
    free = "".join(generate(model, prompt, 40, temperature=0, tokenizer=tok))
    plain, ours[:] = list(ours), []
    assert len(set(plain)) < 20 and free   # it repeats itself: the penalties bite
    ban = plain[0]
    stop = [t for t in plain if t != ban][5]
    text = "".join(generate(model, prompt, 40, temperature=0, tokenizer=tok, token_ban=(ban,),
                            token_stop=(stop,), **kw))
    pipe = utils.PIPELINE(_PipelineModel(model), "rwkv_vocab_v20230424")
    theirs = []
    real_pipe = pipe.sample_logits
    pipe.sample_logits = lambda *a, **k: theirs.append(real_pipe(*a, **k)) or theirs[-1]
    their_text = pipe.generate(prompt, token_count=40, args=utils.PIPELINE_ARGS(
        temperature=0, top_p=0, token_ban=[ban], token_stop=[stop], **kw))
    assert ours == theirs and ours != plain and ours[-1] == stop and ban not in ours
    assert text == their_text


# ---------------------------------------------------------- stop strings


def test_generate_stops_at_a_stop_string():
    m = rx.RxPtModel(RWKV, seed=7)
    whole = "".join(generate(m, "def f(", 60, temperature=0))
    assert len(whole) > 20
    stop = whole[12:15]
    cut = whole[:whole.find(stop)]
    assert "".join(generate(m, "def f(", 60, temperature=0, stop=(stop,))) == cut
    assert "".join(generate(m, "def f(", 60, temperature=0, stop=("\x00\x01", stop))) == cut
    # a stop string that never comes changes nothing
    assert "".join(generate(m, "def f(", 60, temperature=0, stop=("\x00\x01",))) == whole


def test_sample_stop_ends_the_reply(tmp_path, capsysbinary):
    run = _save(bigram_model(), str(tmp_path / "run"))
    prompt = "User: Hi\n\nAssistant:"
    args = ["sample", run, "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12"]
    assert main(args) == 0
    assert capsysbinary.readouterr().out == (prompt + " OK." + "\n" * 8 + "\n").encode()
    assert main([*args, "--stop", "\n\n"]) == 0
    assert capsysbinary.readouterr().out == (prompt + " OK.\n").encode()
    assert main([*args, "--stop", "K", "--stop", "O"]) == 0
    assert capsysbinary.readouterr().out == (prompt + " \n").encode()


# ------------------------------------------------------------ long prompts


_MEGABYTE_PROMPT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
import numpy as np, rwkvx_c as rx
from rwkvx_c.errors import RwkvxError
from rwkvx_c.sample import generate
C = int(sys.argv[2])
cfg = dict(%r, n_attn_layer=int(sys.argv[1]), n_embd=C, n_head=C // 16)
m = rx.RxPtModel(cfg, seed=2)
prompt = bytes(np.random.default_rng(0).integers(32, 127, 1 << 20).astype(np.uint8))
try:
    out = "".join(generate(m, prompt, 3, temperature=0))
except RwkvxError as e:
    print("refused:", e)
else:
    # VmHWM: this program's own peak (ru_maxrss starts at the parent's RSS,
    # which a fork hands down and exec keeps)
    with open("/proc/self/status") as f:
        hwm = next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
    print("done", len(out.encode("utf-8", "replace")) > 0, hwm >> 10)
"""


@pytest.mark.parametrize("attn,n_embd,want", [(0, 32, "done True"),
                                              (1, 1024, "refused: the attention cache")])
def test_a_megabyte_prompt_under_a_4_gib_address_space(attn, n_embd, want):
    """A 1 MB prompt under RLIMIT_AS = 4 GiB: a pure RWKV-7 model reads it
    in pieces and finishes in flat memory; a model with attention whose
    key/value cache for it does not fit refuses in one line before it
    allocates (the address-space limit is part of the memory it sees)."""
    r = subprocess.run([sys.executable, "-c", _MEGABYTE_PROMPT % (RWKV,), str(attn),
                        str(n_embd)], capture_output=True, text=True, timeout=580, cwd=HERE,
                       env=dict(env(), OMP_NUM_THREADS="2"))
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.strip()
    assert out.startswith(want) and "\n" not in out, out
    if attn:
        assert "shorten the prompt or lower --max-new-tokens" in out
    else:
        assert int(out.split()[-1]) < 1024, out   # peak RSS in MB


# ------------------------------------------------------------------ chat


def test_chat_carries_the_state_of_the_rendered_conversation():
    """After each turn the state is that of a fresh state fed the whole
    conversation as the chat template renders it (RWKV's: the reply as its
    content, then the turn's end): through a reply cut by max_new_tokens,
    and one cut by a stop string the state had partly read (the state is
    then rebuilt from the rendered conversation)."""
    m = rx.RxPtModel(HYBRID, seed=3)
    probe = "".join(generate(m, "System: Be brief.\n\nUser: hello\n\nAssistant:", 30,
                             temperature=0))
    assert not any(s in probe[:13] for s in smp.CHAT_STOPS)
    chat = Chat(m, None, Sampling(temperature=0, stop=(probe[10:13],)), 30, 4096,
                system="Be brief.")
    resets = []
    reset = chat.session.reset
    chat.session.reset = lambda: resets.append(1) or reset()
    first = "".join(chat.say("hello"))
    assert first == probe[:10] and resets == [1]   # it had read two bytes of the stop
    second = "".join(chat.say("and then?"))
    want = (f"System: Be brief.\n\nUser: hello\n\nAssistant: {normalise(first)}\n\n"
            f"User: and then?\n\nAssistant: {normalise(second)}\n\n").encode()
    assert chat.transcript.encode() == want
    fresh = Session(m, None, 4096)
    fresh.feed(want)
    assert np.allclose(chat.session.logits, fresh.logits, rtol=1e-4, atol=1e-4)
    assert chat.session.pos == len(want)


def _read_until(fd, want, timeout=120):
    out = b""
    end = time.time() + timeout
    while want not in out:
        left = end - time.time()
        assert left > 0, f"no {want!r} in {out!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                blk = os.read(fd, 4096)
            except OSError:   # the child closed the terminal
                break
            if not blk:
                break
            out += blk
    return out


def test_chat_in_a_terminal(tmp_path):
    """rwkvx-c chat through a pseudo-terminal: each reply stops at the
    turn's end (the bigram model would write newlines for ever), the next
    User: prompt follows, Ctrl-D ends the chat with status 0."""
    run = _save(bigram_model(), str(tmp_path / "run"))
    pid, fd = pty.fork()
    if pid == 0:   # the child: the command on the terminal
        os.chdir(HERE)
        os.execve(sys.executable, [sys.executable, "-m", "rwkvx_c", "chat", run,
                                   "--temperature", "0", "--max-new-tokens", "40"], env())
    try:
        seen = _read_until(fd, b"User: ")
        os.write(fd, b"Hi\n")
        seen += _read_until(fd, b"User: ")
        os.write(fd, b"And again?\n")
        seen += _read_until(fd, b"And again?\r\nAssistant: OK.\r\n\r\nUser: ")
        os.write(fd, b"\x04")
        seen += _read_until(fd, b"\n")
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    text = seen.replace(b"\r\n", b"\n").decode()
    assert text.count("Assistant: OK.\n\nUser: ") == 2, text
    assert "OK.\n\n\n" not in text
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, text


def test_a_chat_past_its_context_is_one_line():
    m = rx.RxPtModel(HYBRID, seed=3)
    # the question fits, a reply of 20 tokens after it would not
    with pytest.raises(SampleError, match=r"holds 20 positions; a reply of up to 20 tokens "
                                          "would pass the 30 of --context: raise it or start"):
        "".join(Chat(m, None, Sampling(temperature=0), 20, 30).say("hi"))
    # the question itself does not fit
    with pytest.raises(SampleError, match="the text reaches 55 positions, past the 30 this "
                                          "model's attention cache holds; raise --context"):
        "".join(Chat(m, None, Sampling(temperature=0), 20, 30).say("a" * 37))
    # without attention the state has a fixed size: nothing bounds a chat
    chat = Chat(rx.RxPtModel(RWKV), None, Sampling(temperature=0), 20, 64)
    for _ in range(4):
        "".join(chat.say("and a question long enough to pass the end"))
    assert len(chat.transcript) > 64
