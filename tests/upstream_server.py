"""A small OpenAI-compatible server for the proxy tests: it stands in for the LLM server.

It records every request it receives (method, path, headers, raw body bytes) and answers by the request's
``model``:

- ``error-400`` / ``error-500``: an OpenAI-style error body with that status;
- ``stream: true``: ``chat.completion.chunk`` server-sent events ``Hel``, ``lo``, then ``data: [DONE]``;
  ``gated``: after the first chunk it waits until the test releases :attr:`FakeUpstream.gate` (so a test can
  prove the first chunk reached the client before the rest was even produced); ``stream-error``: an error
  event after the first chunk; ``stream-drop``: the connection drops after the first chunk;
- ``slow-headers``: waits ``x_delay`` seconds (default 5) before answering; ``slow-stream``: waits ``x_delay``
  seconds after the first chunk (either stops waiting when the client disconnects); ``invalid-json``: a 200
  ``application/json`` body that is not JSON;
  ``gzip-json`` / ``gzip-invalid``: a gzip-encoded completion / non-JSON body; ``html-502``: a 502 HTML page
  (a load balancer's error, not JSON);
- otherwise a ``chat.completion`` whose content is ``ok``.

``POST /v1/messages`` (Anthropic's Messages API) and ``POST /v1/responses`` (OpenAI's Responses API) answer in
their API's shape: ``error-400`` / ``error-500`` as above (Anthropic's error shape on messages), ``stream: true``
as that API's server-sent events with the text ``Hel`` + ``lo`` (``gated`` as above, after the ``Hel`` event),
otherwise a message / response whose text is ``ok``.

The Gemini API (``/v1beta/...`` and ``/v1/models/{model}:{method}``) answers in its shape, by the model the path
names: ``error-400`` / ``error-500`` a Google-shaped error; ``:generateContent`` a response whose text is ``ok``;
``:streamGenerateContent`` with ``alt=sse`` the events ``Hel`` + ``lo`` (``data: {...}`` and CRLF, as Google sends
them), without it one JSON array sent as ``application/json`` in two halves (``gated`` as above, after the
first); ``:countTokens`` ``{"totalTokens": 3}``; ``GET /v1beta/models`` a model list; another path a 404.

Also ``GET /v1/models``, ``POST /v1/embeddings`` and ``POST /v1/completions``. :class:`ServerThread` runs any
ASGI app under uvicorn on 127.0.0.1 in a background thread.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import uvicorn

UNLIMITED_MS = 86_400_000  # a time budget no test reaches: a day
MODELS = {"object": "list", "data": [{"id": "fake-llm", "object": "model", "created": 0, "owned_by": "tests"}]}


@dataclass
class Recorded:
    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes
    client: tuple[str, int] | None = None  # the proxy's end of the connection

    def header(self, name: str) -> str | None:
        vals = [v for k, v in self.headers if k == name.lower()]
        return vals[-1] if vals else None

    def json(self) -> Any:
        return json.loads(self.body)


def _chunk(content: str | None, finish: str | None = None) -> bytes:
    delta = {"content": content} if content is not None else {}
    data = {
        "id": "chatcmpl-test",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "fake-llm",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def _completion(content: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": "fake-llm",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


ERROR_400 = {"error": {"message": "bad thing", "type": "invalid_request_error", "param": "model", "code": "bad"}}
ANTHROPIC_400 = {"type": "error", "error": {"type": "invalid_request_error", "message": "bad thing"}}
ANTHROPIC_500 = {"type": "error", "error": {"type": "api_error", "message": "upstream broke"}}
_MESSAGE = {"id": "msg_test", "type": "message", "role": "assistant", "model": "fake-llm", "stop_sequence": None}
_RESPONSE = {"id": "resp_test", "object": "response", "created_at": 0, "model": "fake-llm", "tools": []}


def _anthropic(text: str | None) -> dict[str, Any]:
    """A Messages API message: its text (None: empty, as in ``message_start``)."""
    content = [{"type": "text", "text": text}] if text is not None else []
    usage = {"input_tokens": 1, "output_tokens": 1}
    return {**_MESSAGE, "content": content, "stop_reason": "end_turn" if text else None, "usage": usage}


def _response(text: str | None) -> dict[str, Any]:
    """A Responses API response: its output text (None: in progress, no output yet)."""
    if text is None:
        return {**_RESPONSE, "status": "in_progress", "output": []}
    part = {"type": "output_text", "text": text, "annotations": []}
    item = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant", "content": [part]}
    return {**_RESPONSE, "status": "completed", "output": [item]}


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def _messages_events(text: str) -> tuple[list[bytes], list[bytes]]:
    """The Messages API stream of ``text`` (in two deltas): the events up to the first delta, and the rest."""
    delta = {"type": "content_block_delta", "index": 0}
    head = [
        _event("message_start", {"type": "message_start", "message": _anthropic(None)}),
        _event(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": _anthropic("")["content"][0]},
        ),
        _event("content_block_delta", {**delta, "delta": {"type": "text_delta", "text": text[:3]}}),
    ]
    tail = [
        _event("content_block_delta", {**delta, "delta": {"type": "text_delta", "text": text[3:]}}),
        _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _event(
            "message_delta",
            {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}},
        ),
        _event("message_stop", {"type": "message_stop"}),
    ]
    return head, tail


def _responses_events(text: str) -> tuple[list[bytes], list[bytes]]:
    """The Responses API stream of ``text`` (in two deltas): the events up to the first delta, and the rest."""
    at = {"item_id": "msg_1", "output_index": 0, "content_index": 0, "logprobs": []}
    head = [
        _event("response.created", {"type": "response.created", "sequence_number": 0, "response": _response(None)}),
        _event(
            "response.output_text.delta",
            {"type": "response.output_text.delta", "sequence_number": 1, "delta": text[:3], **at},
        ),
    ]
    tail = [
        _event(
            "response.output_text.delta",
            {"type": "response.output_text.delta", "sequence_number": 2, "delta": text[3:], **at},
        ),
        _event("response.completed", {"type": "response.completed", "sequence_number": 3, "response": _response(text)}),
    ]
    return head, tail


# path: (error 400 body, error 500 body, the answer, the stream's events)
APIS: dict[str, tuple[Any, Any, Any, Any]] = {
    "/v1/messages": (ANTHROPIC_400, ANTHROPIC_500, _anthropic, _messages_events),
    "/v1/responses": (
        ERROR_400,
        {"error": {"message": "upstream broke", "type": "server_error"}},
        _response,
        _responses_events,
    ),
}
ERROR_500 = {"error": {"message": "upstream broke", "type": "server_error", "param": None, "code": None}}
GOOGLE_400 = {"error": {"code": 400, "message": "bad thing", "status": "INVALID_ARGUMENT"}}
GOOGLE_500 = {"error": {"code": 500, "message": "upstream broke", "status": "INTERNAL"}}


def _gemini(text: str, finish: bool = True) -> dict[str, Any]:
    """A Gemini GenerateContentResponse (or one chunk of a stream) whose text is ``text``."""
    candidate: dict[str, Any] = {"content": {"parts": [{"text": text}], "role": "model"}, "index": 0}
    if finish:
        candidate["finishReason"] = "STOP"
    usage = {"promptTokenCount": 1, "candidatesTokenCount": 1, "totalTokenCount": 2}
    return {"candidates": [candidate], "usageMetadata": usage, "modelVersion": "fake-gemini", "responseId": "r-1"}


def _is_gemini(path: str) -> bool:
    return path.startswith("/v1beta/") or (path.startswith("/v1/models/") and ":" in path.rsplit("/", 1)[-1])


STREAM_ERROR = {"error": {"message": "upstream exploded mid-stream", "type": "server_error", "code": "boom"}}


async def request_body(scope: dict[str, Any], receive: Any, send: Any) -> bytes | None:
    """An ASGI app's first step: answer the lifespan protocol (None), or read the whole request body."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            await send({"type": msg["type"] + ".complete"})
            if msg["type"] == "lifespan.shutdown":
                return None
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body


class FakeUpstream:
    """A raw ASGI app (full control over when bytes are sent and when the connection drops)."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.gate = threading.Event()
        self.gate_released: bool | None = None

    def last(self, path: str = "/v1/chat/completions") -> Recorded:
        return [r for r in self.requests if r.path == path][-1]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = await request_body(scope, receive, send)
        if body is None:
            return
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        client = tuple(scope["client"]) if scope.get("client") else None
        rec = Recorded(scope["method"], scope["path"], scope["query_string"].decode(), headers, body, client)
        self.requests.append(rec)
        path = scope["path"]
        if path == "/v1/models" and scope["method"] == "GET":
            return await self._json(send, 200, MODELS)
        if path == "/v1/embeddings":
            return await self._json(
                send,
                200,
                {
                    "object": "list",
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.25]}],
                    "model": "fake-emb",
                    "usage": {"prompt_tokens": 1, "total_tokens": 1},
                },
            )  # noqa: E501
        if path == "/v1/completions":
            return await self._json(
                send,
                200,
                {
                    "id": "cmpl-test",
                    "object": "text_completion",
                    "created": 0,
                    "model": "fake-llm",
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}],
                },
            )  # noqa: E501
        if path in APIS and scope["method"] == "POST":
            return await self._api(path, json.loads(body), send)
        if _is_gemini(path):
            return await self._gemini(path, scope["query_string"], send)
        if path != "/v1/chat/completions":
            return await self._json(
                send, 404, {"error": {"message": f"no route {path}", "type": "invalid_request_error"}}
            )
        req = json.loads(body)
        model = req.get("model")
        delay = float(req.get("x_delay", 5))
        if model == "slow-headers":
            await _pause(receive, delay)
        if model == "invalid-json":
            return await self._raw(send, 200, b'{"id": "chatcmpl-test", "choices": [{"index": 0, "mess')
        if model in ("gzip-json", "gzip-invalid"):
            data = json.dumps(_completion("ok")).encode() if model == "gzip-json" else b"<html>oops</html>"
            return await self._raw(send, 200, gzip.compress(data), [(b"content-encoding", b"gzip")])
        if model == "html-502":
            page = b"<html><body>502 Bad Gateway</body></html>"
            return await self._raw(send, 502, page, [], b"text/html")
        if model == "error-400":
            return await self._json(send, 400, ERROR_400)
        if model == "error-500":
            return await self._json(send, 500, ERROR_500)
        if not req.get("stream"):
            return await self._json(send, 200, _completion("ok"))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
            }
        )
        await send({"type": "http.response.body", "body": _chunk("Hel"), "more_body": True})
        if model == "gated":
            self.gate_released = await anyio.to_thread.run_sync(self.gate.wait, 20.0)
        elif model == "slow-stream":
            await _pause(receive, delay)
        elif model == "stream-error":
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + json.dumps(STREAM_ERROR).encode() + b"\n\n",
                    "more_body": True,
                }
            )  # noqa: E501
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        elif model == "stream-drop":
            await anyio.sleep(0.05)
            return  # the response is left incomplete: uvicorn closes the connection
        await send({"type": "http.response.body", "body": _chunk("lo"), "more_body": True})
        await send({"type": "http.response.body", "body": _chunk(None, "stop"), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _api(self, path: str, req: dict[str, Any], send: Any) -> None:
        """Answer a Messages or Responses API request in its API's shape (see the module docstring)."""
        error_400, error_500, answer, events = APIS[path]
        model = req.get("model")
        if model in ("error-400", "error-500"):
            return await self._json(
                send, 400 if model == "error-400" else 500, error_400 if model == "error-400" else error_500
            )
        if not req.get("stream"):
            return await self._json(send, 200, answer("ok"))
        head, tail = events("Hello")
        start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
        await send(start)
        for chunk in head:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if model == "gated":
            self.gate_released = await anyio.to_thread.run_sync(self.gate.wait, 20.0)
        for chunk in tail:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _gemini(self, path: str, query: bytes, send: Any) -> None:
        """Answer a Gemini API request in its shape (see the module docstring)."""
        name, _, method = path.rsplit("/", 1)[-1].partition(":")
        if path == "/v1beta/models":
            return await self._json(send, 200, {"models": [{"name": "models/fake-gemini"}]})
        if name in ("error-400", "error-500"):
            return await self._json(
                send, 400 if name == "error-400" else 500, GOOGLE_400 if "400" in name else GOOGLE_500
            )
        if method == "generateContent":
            return await self._json(send, 200, _gemini("ok"))
        if method == "countTokens":
            return await self._json(send, 200, {"totalTokens": 3})
        if method != "streamGenerateContent":
            return await self._json(send, 404, {"error": {"code": 404, "message": "no route", "status": "NOT_FOUND"}})
        sse = b"alt=sse" in query.split(b"&")
        first, last = _gemini("Hel", finish=False), _gemini("lo")
        if sse:
            head, tail = (
                [b"data: " + json.dumps(first).encode() + b"\r\n\r\n"],
                [b"data: " + json.dumps(last).encode() + b"\r\n\r\n"],
            )
        else:  # one JSON array, streamed as Google streams it
            head, tail = [b"[" + json.dumps(first).encode()], [b"\n,\r\n" + json.dumps(last).encode() + b"]"]
        ctype = b"text/event-stream" if sse else b"application/json"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]})
        for chunk in head:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if name == "gated":
            self.gate_released = await anyio.to_thread.run_sync(self.gate.wait, 20.0)
        for chunk in tail:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _raw(
        send: Any,
        status: int,
        body: bytes,
        extra: list[tuple[bytes, bytes]] | None = None,
        ctype: bytes = b"application/json",
    ) -> None:
        headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode()), *(extra or [])]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    @staticmethod
    async def _json(send: Any, status: int, data: Any) -> None:
        body = json.dumps(data).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def _pause(receive: Any, seconds: float) -> None:
    """Wait ``seconds``, or until the client disconnects (a slow answer nobody waits for ends there)."""
    with anyio.move_on_after(seconds):
        while (await receive())["type"] != "http.disconnect":
            pass


class ServerThread:
    """Serve an ASGI app with uvicorn on 127.0.0.1 (a free port) in a daemon thread; ``options``: more
    ``uvicorn.Config`` arguments (e.g. the proxy's own, :func:`rag_opt.server.http.uvicorn_options`)."""

    def __init__(self, app: Any, **options: Any) -> None:
        # proto IPPROTO_TCP (not 0): asyncio then sets TCP_NODELAY on accepted connections, as it does for a
        # socket it creates itself (uvicorn.run); without it, Nagle + delayed ACKs add ~40 ms per response
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        # (proxy_headers off: a server records its real peer, not the X-Forwarded-For the proxy sends it)
        values = {"server_header": False, "date_header": False, "access_log": False, "proxy_headers": False, **options}
        config = uvicorn.Config(app, log_level="warning", lifespan="on", **values)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


# -- helpers for the proxy tests ------------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@contextmanager
def serve_proxy(upstream_url: str, optimizer: Any, **settings: Any) -> Iterator[tuple[str, Any]]:
    """Run the proxy app in front of ``upstream_url`` (for ``--upstream`` and ``--gemini-upstream``) with the
    serving options of ``rag-opt serve`` (uvicorn, 127.0.0.1); yields (url, ProxyState). The time budget is a day:
    a test of optimization never depends on the machine's speed (tests of the budget itself use
    :class:`BudgetClock`)."""
    from rag_opt.server.app import create_app
    from rag_opt.server.http import uvicorn_options
    from rag_opt.server.settings import ProxySettings

    values = {
        "upstream": f"{upstream_url}/v1",
        "gemini_upstream": upstream_url,  # the Gemini API's paths go to the same loopback server, never to Google
        "time_budget_ms": UNLIMITED_MS,
        "warmup": False,
        "tool_min_chars": 300,
    }
    proxy_settings = ProxySettings(**{**values, **settings})
    app = create_app(proxy_settings, optimizer=optimizer)
    with ServerThread(app, **uvicorn_options(proxy_settings, app.state.ragopt.metrics)) as server:
        yield server.url, app.state.ragopt


class BudgetClock:
    """Decides when the proxy's optimizer time budgets run out, instead of the wall clock: :meth:`install` it
    on a ``ProxyState``, then every budget waiting meanwhile (and later) runs out at :meth:`expire`."""

    def __init__(self) -> None:
        self.expired = threading.Event()

    def install(self, state: Any) -> None:
        state.pool.sleep = self.sleep

    async def sleep(self, seconds: float) -> None:
        await anyio.to_thread.run_sync(self.expired.wait, abandon_on_cancel=True)

    def expire(self) -> None:
        self.expired.set()


def bm25_optimizer() -> Any:
    """rag-opt's real pipeline with the BM25 scorer (no proxy model)."""
    from rag_opt import ContextOptimizer
    from rag_opt.compressors import BM25Scorer

    return ContextOptimizer(scorer=BM25Scorer())


def upstream_pool_is_clean(state: Any) -> bool:
    """No request is in flight on the proxy's upstream connection pool and no connection is left mid-response."""
    pool = state.upstream.client._transport._pool
    return not pool._requests and all(c.is_idle() or c.is_closed() for c in pool.connections)
