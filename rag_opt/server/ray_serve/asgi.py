"""Driving an ASGI app from outside a web server: its lifespan, and one HTTP request whose body is already read.

A Ray Serve replica runs the rag-opt proxy app (:func:`rag_opt.server.app.create_app`) as it is, without uvicorn:
:class:`Lifespan` starts it (the upstream client, the model's warm-up) and stops it (pools, caches), and
:func:`serve_request` runs one request through it and yields what it sends (the response's start and body
chunks, in batches: a JSON answer is usually one batch, a stream one batch per event the app sent since the last
one). A request is a :class:`ForwardedRequest`: the parts of the ingress's ASGI scope the app reads, and the body.
No Ray here: plain asyncio, testable on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message

__all__ = ["ForwardedRequest", "Lifespan", "serve_request"]

logger = logging.getLogger(__name__)

_ASGI = {"version": "3.0", "spec_version": "2.3"}


@dataclass(frozen=True)
class ForwardedRequest:
    """One HTTP request as the ingress received it: what an ASGI app reads of its scope, and the whole body
    (picklable: it travels from the ingress to a replica)."""

    method: str
    path: str
    body: bytes = b""
    raw_path: bytes | None = None
    query_string: bytes = b""
    headers: Sequence[tuple[bytes, bytes]] = field(default_factory=tuple)
    root_path: str = ""
    scheme: str = "http"
    http_version: str = "1.1"
    client: tuple[str, int] | None = None
    server: tuple[str, int] | None = None

    @classmethod
    def from_scope(cls, scope: Mapping[str, Any], body: bytes, drop_headers: Sequence[bytes] = ()) -> ForwardedRequest:
        """The request of an ASGI HTTP ``scope`` (the ingress's), with its ``body``, without the headers named in
        ``drop_headers`` (lower case)."""
        client, server = scope.get("client"), scope.get("server")
        return cls(
            method=str(scope["method"]),
            path=str(scope["path"]),
            body=body,
            raw_path=scope.get("raw_path"),
            query_string=scope.get("query_string", b""),
            headers=tuple(
                (bytes(k), bytes(v)) for k, v in scope.get("headers", ()) if bytes(k).lower() not in drop_headers
            ),
            root_path=str(scope.get("root_path", "")),
            scheme=str(scope.get("scheme", "http")),
            http_version=str(scope.get("http_version", "1.1")),
            client=(str(client[0]), int(client[1])) if client else None,
            server=(str(server[0]), int(server[1] or 0)) if server else None,
        )

    def scope(self, state: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The ASGI HTTP scope to call an app with (``state``: the app's lifespan state, copied)."""
        return {
            "type": "http",
            "asgi": dict(_ASGI),
            "http_version": self.http_version,
            "method": self.method,
            "scheme": self.scheme,
            "path": self.path,
            "raw_path": self.raw_path if self.raw_path is not None else self.path.encode("utf-8", "surrogateescape"),
            "query_string": self.query_string,
            "root_path": self.root_path,
            "headers": [(k, v) for k, v in self.headers],
            "client": self.client,
            "server": self.server,
            "state": dict(state or {}),
        }


class Lifespan:
    """The ASGI lifespan protocol of ``app``: :meth:`startup` before the first request, :meth:`shutdown` at the end
    (as uvicorn runs it). ``state`` is the lifespan state the app may fill, given to every request's scope."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.state: dict[str, Any] = {}
        self._receive: asyncio.Queue[Message] = asyncio.Queue()
        self._sent: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        """Started, and the app's lifespan has not ended (it ends at shutdown, or when it fails)."""
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        scope = {"type": "lifespan", "asgi": dict(_ASGI), "state": self.state}
        try:
            await self.app(scope, self._receive.get, self._send)
        except Exception as exc:  # the app failed outside a message: whoever waits is told
            logger.error("the app's lifespan failed (%s)", type(exc).__name__)
            self._sent.put_nowait({"type": "lifespan.failed", "message": type(exc).__name__})
        finally:
            self._sent.put_nowait({"type": "lifespan.ended"})

    async def _send(self, message: Message) -> None:
        self._sent.put_nowait(message)

    async def startup(self) -> None:
        """Start the app; raises RuntimeError if its startup fails."""
        self._task = asyncio.get_running_loop().create_task(self._run())
        self._receive.put_nowait({"type": "lifespan.startup"})
        message = await self._sent.get()
        if message["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app failed to start: {message.get('message') or message['type']}")

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the app (at most ``timeout`` seconds, then its lifespan is cancelled). Idempotent."""
        task, self._task = self._task, None
        if task is None:
            return
        if not task.done():
            self._receive.put_nowait({"type": "lifespan.shutdown"})
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout)
            except asyncio.TimeoutError:
                logger.warning("the app did not stop within %.0f s: its lifespan is cancelled", timeout)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


async def serve_request(
    app: ASGIApp,
    request: ForwardedRequest,
    *,
    state: Mapping[str, Any] | None = None,
    extra_headers: Sequence[tuple[bytes, bytes]] = (),
) -> AsyncIterator[list[Message]]:
    """Run ``request`` through ``app`` and yield the messages it sends, in batches (each batch what it sent since
    the last one was taken). ``extra_headers`` are added to the response's start. The body is received at once;
    then ``receive`` waits, and answers ``http.disconnect`` when the caller stops iterating (the client left: the
    app cancels its work). The app's own exception, if it raises, is raised here after what it sent."""
    queue: asyncio.Queue[Message | None] = asyncio.Queue()
    left = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start" and extra_headers:
            message = {**message, "headers": [*message.get("headers", ()), *extra_headers]}
        queue.put_nowait(message)

    async def run() -> None:
        try:
            await app(request.scope(state), receive, send)
        finally:
            queue.put_nowait(None)

    task = asyncio.get_running_loop().create_task(run())
    try:
        done = False
        while not done:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            done = batch[-1] is None
            out = [m for m in batch if m is not None]
            if out:
                yield out
        await task  # its exception, if any
    finally:
        left.set()
        if not task.done():  # the caller stopped early: the app sees the disconnect, then is cancelled
            await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
