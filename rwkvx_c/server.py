"""An OpenAI-compatible HTTP server over the live engine
(rwkvx_c.generation.live): ``rwkvx-c serve`` (docs/training.md §Serving).

    POST /v1/completions        {"prompt": TEXT | [TEXT, ...], "max_tokens": N, ...}
    POST /v1/chat/completions   {"messages": [{"role", "content"}, ...], "stream": true, ...}
    GET  /v1/models

The HTTP layer is the standard library's ThreadingHTTPServer: no
dependency to install, a thread per connection, which is plenty when the
model's step, not the HTTP parsing, is the cost; every request's tokens
are drawn in the one batch of the engine's scheduler thread. A chat's
messages are rendered with the run's chat template (the one it trained
with, rwkvx_c.data.templates) and its reply stops where the template ends
a turn. Streaming answers are server-sent events (``data: {chunk}`` lines,
then ``data: [DONE]``) over chunked transfer encoding. A malformed request
gets a 4xx answer with OpenAI's error body, ``{"error": {"message",
"type", "param", "code"}}``.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rwkvx_c.data.templates import ChatTemplate
from rwkvx_c.data.tokenizers import Tokenizer
from rwkvx_c.errors import ApiError, DataError, SampleError
from rwkvx_c.generation.live import LiveEngine, LiveRequest
from rwkvx_c.generation.sampling import Sampling
from rwkvx_c.sample import reply_stops

__all__ = ["Server", "ApiError", "make_server", "DEFAULT_HOST", "DEFAULT_PORT", "MAX_BODY"]

DEFAULT_HOST = "127.0.0.1"   # this machine only, unless --host says otherwise
DEFAULT_PORT = 8000
MAX_BODY = 16 << 20          # bytes of one request's JSON
MAX_N = 16                   # choices of one request
COMPLETION_TOKENS = 16       # /v1/completions' max_tokens when none is given (OpenAI's)
FINISH = {"length": "length", "stop": "stop", "stop_id": "stop"}   # stop_reason -> finish_reason


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not lo <= v <= hi:
        raise ApiError(400, f"{key} must be a number in [{lo:g}, {hi:g}], got {v!r}", key)
    return float(v)


def _integer(body: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ApiError(400, f"{key} must be an integer in [{lo}, {hi}], got {v!r}", key)
    return v


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = (v,) if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > 4 or \
            any(not isinstance(s, str) or not s for s in stops):
        raise ApiError(400, "stop must be a non-empty string or a list of up to 4", "stop")
    return tuple(stops)


def _text(content: object, i: int) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                   "messages")


class Server:
    """The OpenAI endpoints over engine: tok encodes prompts, template
    renders chats, name is the model's id, max_tokens the default and
    largest max_tokens of a chat."""

    def __init__(self, engine: LiveEngine, tok: Tokenizer, template: ChatTemplate, name: str,
                 max_tokens: int) -> None:
        self.engine, self.tok, self.template, self.name = engine, tok, template, name
        self.max_tokens = max_tokens
        self.created = int(time.time())
        self.chat_stops = reply_stops(template)
        # a reply starts with what the template puts before a turn's content
        # (RWKV's space after "Assistant:"), which the message leaves out
        self.lstrip_reply = bool(template.lead) and not template.lead.strip()

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.name, "object": "model",
                                            "created": self.created, "owned_by": "rwkvx_c"}]}

    def _sampling(self, body: dict[str, Any], extra_stops: tuple[str, ...]) -> Sampling:
        try:
            return Sampling(temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                            top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
                            top_k=_integer(body, "top_k", 0, 0, 1 << 30),
                            alpha_presence=_number(body, "presence_penalty", 0.0, 0.0, 2.0),
                            alpha_frequency=_number(body, "frequency_penalty", 0.0, 0.0, 2.0),
                            alpha_decay=1.0, stop=_stops(body) + extra_stops)
        except SampleError as e:
            raise ApiError(400, str(e)) from None

    def requests(self, body: dict[str, Any], chat: bool) -> tuple[list[LiveRequest], int]:
        """The engine requests of a body (one per prompt and choice), queued,
        and their prompt token count; ApiError for a malformed body."""
        for key in ("logprobs", "echo", "suffix", "tools", "functions", "best_of"):
            if body.get(key) not in (None, False, 1 if key == "best_of" else None):
                raise ApiError(400, f"{key} is not supported by this server", key)
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise ApiError(400, "messages must be a non-empty list of {role, content}",
                               "messages")
            conv = []
            for i, m in enumerate(msgs):
                if not isinstance(m, dict) or m.get("role") not in ("system", "user",
                                                                     "assistant"):
                    raise ApiError(400, f"messages[{i}] must be an object whose role is "
                                   "system, user or assistant", "messages")
                conv.append({"role": m["role"], "content": _text(m.get("content"), i)})
            try:
                prompts = [self.template.render(conv, add_generation_prompt=True)]
            except DataError as e:
                raise ApiError(400, str(e), "messages") from None
            default = self.max_tokens
        else:
            p = body.get("prompt")
            given = [p] if isinstance(p, str) else p
            if not isinstance(given, list) or not given or \
                    any(not isinstance(x, str) for x in given):
                raise ApiError(400, "prompt must be a string or a non-empty list of strings",
                               "prompt")
            prompts = [str(x) for x in given]
            default = COMPLETION_TOKENS
        key = "max_completion_tokens" if chat and "max_completion_tokens" in body \
            else "max_tokens"
        max_new = _integer(body, key, default, 1, self.engine.context)
        n = _integer(body, "n", 1, 1, MAX_N)
        seed = _integer(body, "seed", 0, 0, 2 ** 63 - 1)
        s = self._sampling(body, self.chat_stops if chat else ())
        reqs, used = [], 0
        try:
            for p in prompts:
                ids = self.tok.encode(p) if p else self.tok.encode("\n")
                used += len(ids)
                for j in range(n):
                    reqs.append(LiveRequest(ids, s, max_new, seed + j))
            for r in reqs:
                self.engine.submit(r)
        except SampleError as e:
            for r in reqs:
                r.cancel()
            raise ApiError(400, str(e)) from None
        return reqs, used

    def _collect(self, req: LiveRequest) -> tuple[str, str, int]:
        """(text, finish_reason, tokens) of a finished request."""
        while True:
            kind, v = req.events.get()
            if kind == "done":
                return v.text, FINISH[v.stop_reason], len(v.token_ids)
            if kind == "error":
                raise ApiError(500, v, kind="server_error")

    def answer(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        """The whole (not streamed) answer to a body."""
        reqs, used = self.requests(body, chat)
        choices, made = [], 0
        try:
            for i, r in enumerate(reqs):
                text, finish, k = self._collect(r)
                made += k
                if chat:
                    content = text.lstrip() if self.lstrip_reply else text
                    choices.append({"index": i, "finish_reason": finish, "logprobs": None,
                                    "message": {"role": "assistant", "content": content}})
                else:
                    choices.append({"index": i, "text": text, "finish_reason": finish,
                                    "logprobs": None})
        finally:
            for r in reqs:
                r.cancel()
        return {"id": _id(chat), "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.name, "choices": choices,
                "usage": {"prompt_tokens": used, "completion_tokens": made,
                          "total_tokens": used + made}}

    def stream(self, body: dict[str, Any], chat: bool) -> Iterator[dict[str, Any]]:
        """The chunks of a streamed answer, each choice's text as it is drawn
        (the request is checked and queued before the first chunk)."""
        reqs, _ = self.requests(body, chat)
        return self._chunks(reqs, chat)

    def _chunks(self, reqs: list[LiveRequest], chat: bool) -> Iterator[dict[str, Any]]:
        rid, created = _id(chat), int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i: int, text: str | None, finish: str | None,
                  role: bool = False) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": i, "text": text or "", "finish_reason": finish,
                          "logprobs": None}
            return {"id": rid, "object": kind, "created": created, "model": self.name,
                    "choices": [choice]}
        try:
            for i, r in enumerate(reqs):   # choices one after another, each as it is drawn
                if chat:
                    yield chunk(i, "", None, role=True)
                lead = self.lstrip_reply and chat
                while True:
                    ev, v = r.events.get()
                    if ev == "text":
                        text = v.lstrip() if lead else v
                        lead = lead and not text
                        if text:
                            yield chunk(i, text, None)
                    elif ev == "done":
                        yield chunk(i, None if chat else "", FINISH[v.stop_reason])
                        break
                    else:
                        raise ApiError(500, v, kind="server_error")
        finally:
            for r in reqs:
                r.cancel()


def _id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, status: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: ApiError) -> None:
        self._send(e.status, e.body())

    def do_GET(self) -> None:
        if self.path.rstrip("/") in ("/v1/models", "/models"):
            self._send(200, self.server.app.models())
        else:
            self._error(ApiError(404, f"no such endpoint: GET {self.path}", kind="not_found"))

    def _body(self) -> dict[str, Any]:
        try:
            size = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise ApiError(400, "bad Content-Length") from None
        if size > MAX_BODY:
            self.close_connection = True   # its body is left unread
            raise ApiError(413, f"the request body passes {MAX_BODY} bytes")
        raw = self.rfile.read(size) if size > 0 else b""
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def do_POST(self) -> None:
        path = self.path.rstrip("/")
        chat = path in ("/v1/chat/completions", "/chat/completions")
        if not chat and path not in ("/v1/completions", "/completions"):
            self.close_connection = True   # its body is left unread
            self._error(ApiError(404, f"no such endpoint: POST {self.path}", kind="not_found"))
            return
        try:
            body = self._body()
            if body.get("stream"):
                self._stream(self.server.app.stream(body, chat))
            else:
                self._send(200, self.server.app.answer(body, chat))
        except ApiError as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _stream(self, chunks: Iterator[dict[str, Any]]) -> None:
        """Server-sent events over chunked transfer encoding; a client gone
        away ends the generation (the iterator's finally cancels it)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def put(data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        try:
            for c in chunks:
                put(b"data: " + json.dumps(c, ensure_ascii=False).encode() + b"\n\n")
        except ApiError as e:   # the headers went: the error is the last event
            put(b"data: " + json.dumps(e.body()).encode() + b"\n\n")
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
        put(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    app: Server
    verbose: bool


def make_server(app: Server, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                verbose: bool = False) -> _HTTPServer:
    """The HTTP server of app bound to host:port (port 0: any free one),
    not yet serving (serve_forever)."""
    httpd = _HTTPServer((host, port), _Handler)
    httpd.app, httpd.verbose = app, verbose
    return httpd
