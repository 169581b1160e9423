"""Relaying an upstream's response to the client as it arrives: status, headers and the raw body bytes, chunk by
chunk (:class:`Relay`), and the check a successful JSON response gets before it is relayed (:func:`is_json`, up to
:data:`VALIDATE_BYTES`). The upstream client and its requests are :mod:`rag_opt.server.upstream`'s; this module's
log lines are written under its logger's name.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import AsyncIterator, Sequence

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from rag_opt.server.metrics import Metrics
from rag_opt.server.security import body_for_log, body_log, redact_headers

__all__ = ["VALIDATE_BYTES", "Relay", "is_json", "loggable_url"]

logger = logging.getLogger("rag_opt.server.upstream")  # the upstream's answers: logged (and rate-limited) as its

VALIDATE_BYTES = 16 * 1024 * 1024  # successful JSON responses up to this size are checked before relaying


def loggable_url(url: httpx.URL) -> str:
    """``url`` for a log line: scheme, host, port and path; its user-info (credentials) as ``***``, its query string
    (which may carry a ``key=``) left out."""
    userinfo = "***@" if url.userinfo else ""
    return f"{url.scheme}://{userinfo}{url.netloc.decode('ascii', 'replace')}{url.path}"


def is_json(body: bytes, encoding: str) -> bool:
    """Whether a (possibly gzip/deflate-encoded) response body is JSON; True when it cannot be checked."""
    if encoding in ("gzip", "deflate", "x-gzip"):
        d = zlib.decompressobj(wbits=47 if encoding != "deflate" else 15)  # 47: gzip or zlib header
        try:
            body = d.decompress(body, VALIDATE_BYTES * 4)
            if d.unconsumed_tail:
                return True  # too large to check: relay it
        except zlib.error:
            if encoding != "deflate":
                return False
            try:  # raw deflate (no zlib header)
                body = zlib.decompressobj(wbits=-15).decompress(body, VALIDATE_BYTES * 4)
            except zlib.error:
                return False
    elif encoding not in ("", "identity"):
        return True
    try:
        json.loads(body)
    except (ValueError, RecursionError):
        return False
    return True


class Relay(Response):
    """Relays an upstream response: status, headers and the raw body bytes as they arrive (``prefix``: bytes
    already read from it, ``chunks``: the rest).

    A client disconnect closes the upstream response. An upstream failure after the headers were sent leaves
    the response incomplete, so the server closes the connection and the client sees a broken stream (not a
    clean, truncated one).
    """

    def __init__(
        self,
        upstream: httpx.Response,
        headers: list[tuple[bytes, bytes]],
        metrics: Metrics,
        secrets: tuple[str, ...],
        log_bodies: bool,
        prefix: Sequence[bytes] = (),
        chunks: AsyncIterator[bytes] | None = None,
    ) -> None:
        self.status_code = upstream.status_code
        self.raw_headers = headers
        self.background = None
        self._upstream = upstream
        self._metrics = metrics
        self._secrets = secrets
        self._prefix = prefix
        self._chunks = chunks if chunks is not None else upstream.aiter_raw()
        self._logged: list[bytes] | None = [] if log_bodies else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def watch_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(watch_disconnect)
                await self._relay(send)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._upstream.aclose()
            if self._logged is not None:
                body_log.info(
                    "response %s %s body=%s",
                    self.status_code,
                    redact_headers(self.raw_headers, self._secrets),
                    body_for_log(b"".join(self._logged), self._secrets),
                )

    def _log(self, chunk: bytes) -> None:
        if self._logged is not None and sum(map(len, self._logged)) < 4 * 65536:
            self._logged.append(chunk)

    async def _relay(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for chunk in self._prefix:
            self._log(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        try:
            async for chunk in self._chunks:
                if chunk:
                    self._log(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            self._metrics.upstream_error("stream")
            logger.warning(
                "upstream response broke off: %s (%s); closing the client connection",
                loggable_url(self._upstream.request.url),
                type(exc).__name__,
            )
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
