"""A small OpenAI-compatible server for the proxy tests: it stands in for the LLM server.

It records every request it receives (method, path, headers, raw body bytes) and answers by the request's
``model``:

- ``error-400`` / ``error-500``: an OpenAI-style error body with that status;
- ``stream: true``: ``chat.completion.chunk`` server-sent events ``Hel``, ``lo``, then ``data: [DONE]``;
  ``gated``: after the first chunk it waits until the test releases :attr:`FakeUpstream.gate` (so a test can
  prove the first chunk reached the client before the rest was even produced); ``stream-error``: an error
  event after the first chunk; ``stream-drop``: the connection drops after the first chunk;
- otherwise a ``chat.completion`` whose content is ``ok``.

Also ``GET /v1/models``, ``POST /v1/embeddings`` and ``POST /v1/completions``. :class:`ServerThread` runs any
ASGI app under uvicorn on 127.0.0.1 in a background thread.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import anyio
import uvicorn

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
ERROR_500 = {"error": {"message": "upstream broke", "type": "server_error", "param": None, "code": None}}
STREAM_ERROR = {"error": {"message": "upstream exploded mid-stream", "type": "server_error", "code": "boom"}}


class FakeUpstream:
    """A raw ASGI app (full control over when bytes are sent and when the connection drops)."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.gate = threading.Event()
        self.gate_released: bool | None = None

    def last(self, path: str = "/v1/chat/completions") -> Recorded:
        return [r for r in self.requests if r.path == path][-1]

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                await send({"type": msg["type"] + ".complete"})
                if msg["type"] == "lifespan.shutdown":
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
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
        if path != "/v1/chat/completions":
            return await self._json(
                send, 404, {"error": {"message": f"no route {path}", "type": "invalid_request_error"}}
            )
        req = json.loads(body)
        model = req.get("model")
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


class ServerThread:
    """Serve an ASGI app with uvicorn on 127.0.0.1 (a free port) in a daemon thread."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", server_header=False, date_header=False, access_log=False
        )
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
