"""rwkvx-c serve (docs/training.md §Serving): the live engine lets a request
join while others decode and gives generate's greedy tokens whatever
shares its batch; a real server process answers the openai client and
curl (completions, chat in the run's template, streaming, 8 concurrent
requests equal to generate's), refuses a malformed request with a 4xx JSON
error in OpenAI's shape, listens on 127.0.0.1 by default and stops cleanly
on Ctrl-C."""
import json
import shutil
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
from test_generate import RWKV, _save

import rwkvx_c as rx
from rwkvx_c.data.templates import builtin
from rwkvx_c.data.tokenizers import ByteTokenizer
from rwkvx_c.generation import Sampling, generate
from rwkvx_c.generation.live import LiveEngine, LiveRequest
from rwkvx_c.sample import CHAT_STOPS

PROMPTS = ["def f(", "hello", "x" * 40, "The sea", "a", "import os\n", "ccc", "Once upon"]
GREEDY = Sampling(temperature=0)


def _model():
    return rx.RxPtModel(RWKV, seed=3)


def _greedy(prompts, n, stop=()):
    return [c.text for c in generate(_model(), prompts, max_new_tokens=n,
                                     sampling=Sampling(temperature=0, stop=stop))]


def _wait(req):
    while True:
        kind, v = req.events.get(timeout=120)
        if kind == "done":
            return v
        assert kind == "text"


def test_a_request_joins_while_others_decode():
    tok = ByteTokenizer()
    eng = LiveEngine(_model(), tok, slots=4)
    try:
        first = eng.submit(LiveRequest(tok.encode(PROMPTS[0]), GREEDY, 40))
        assert first.events.get(timeout=120)[0] == "text"   # decoding has begun
        later = [eng.submit(LiveRequest(tok.encode(p), GREEDY, 20)) for p in PROMPTS[1:]]
        got = [_wait(first).text] + [_wait(r).text for r in later]
    finally:
        eng.close()
    assert eng.peak >= 2
    assert got[0] == _greedy(PROMPTS[:1], 40)[0]
    assert got[1:] == _greedy(PROMPTS[1:], 20)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    where = tmp_path_factory.mktemp("serve")
    run = _save(_model(), str(where / "run"))
    # run outside the checkout: the package as installed, not its source tree
    p = subprocess.Popen([sys.executable, "-m", "rwkvx_c", "serve", run, "--port", "0",
                          "--slots", "8", "--threads", "1", "--model-name", "tiny"],
                         stderr=subprocess.PIPE, text=True, cwd=str(where))
    line = p.stderr.readline()
    if "http://" not in line:
        p.kill()
        pytest.fail(f"the server did not start: {line}{p.stderr.read()}")
    url = line.split("at ", 1)[1].split()[0]
    yield p, url, line
    if p.poll() is None:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server[1], api_key="none", timeout=120, max_retries=0)


def test_listens_on_localhost_and_lists_the_model(server, client):
    assert "http://127.0.0.1:" in server[2]
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completions_are_generates_greedy_tokens(client):
    r = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=24,
                                  temperature=0)
    assert [c.text for c in r.choices] == _greedy(PROMPTS[:2], 24)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[1])
    assert r.usage.completion_tokens == 48
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True))
    assert streamed == _greedy(PROMPTS[:1], 24)[0]


def test_chat_in_the_runs_template_streamed_and_not(client):
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    prompt = builtin().render(msgs, add_generation_prompt=True)
    want = _greedy([prompt], 30, CHAT_STOPS)[0].lstrip()
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=30,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=30,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_eight_concurrent_requests(client):
    got = [None] * 8

    def ask(i):
        got[i] = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=16,
                                           temperature=0).choices[0].text
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == _greedy(PROMPTS, 16)


def _post(url, data, path="/completions"):
    req = urllib.request.Request(url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("data,param", [
    (b"{not json", None), (b"[1, 2]", None), (b'{"prompt": 3}', "prompt"),
    (b'{"prompt": "a", "temperature": 9}', "temperature"),
    (b'{"prompt": "a", "max_tokens": 0}', "max_tokens"),
    (b'{"prompt": "a", "stop": [""]}', "stop")])
def test_a_malformed_request_is_a_4xx_json_error(server, data, param):
    status, body = _post(server[1], data)
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert body["error"]["param"] == param
    status, body = _post(server[1], b"{}", "/nowhere")
    assert status == 404 and "error" in body
    status, body = _post(server[1], b'{"messages": [{"role": "robot", "content": "x"}]}',
                         "/chat/completions")
    assert status == 400 and body["error"]["param"] == "messages"


def test_the_openai_client_sees_a_bad_request(client):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="a", temperature=5)


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_curl(server):
    url = server[1]

    def curl(*args):
        r = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", *args], capture_output=True,
                           text=True, timeout=120, check=True)
        body, code = r.stdout.rsplit("\n", 1)
        return int(code), body
    code, body = curl(url + "/models")
    assert code == 200 and json.loads(body)["data"][0]["id"] == "tiny"
    code, body = curl(url + "/completions", "-H", "Content-Type: application/json", "-d",
                      json.dumps({"prompt": "hello", "max_tokens": 12, "temperature": 0}))
    assert code == 200 and json.loads(body)["choices"][0]["text"] == _greedy(["hello"], 12)[0]
    code, body = curl("-N", url + "/chat/completions", "-H", "Content-Type: application/json",
                      "-d", json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                        "max_tokens": 8, "stream": True}))
    events = [x[len("data: "):] for x in body.split("\n") if x.startswith("data: ")]
    assert code == 200 and events[-1] == "[DONE]" and len(events) >= 3
    assert json.loads(events[0])["object"] == "chat.completion.chunk"
    code, body = curl(url + "/completions", "-d", "oops")
    assert code == 400 and "error" in json.loads(body)


def test_ctrl_c_stops_cleanly(server):
    p = server[0]
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=60) == 0
    assert "stopped" in p.stderr.read()
