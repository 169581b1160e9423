"""The HTTP/1.1 connection layer of ``rag-opt serve``: uvicorn's h11 protocol with the limits a server facing
untrusted clients needs, and the uvicorn options that go with it (:func:`uvicorn_options`).

uvicorn provides the keep-alive timeout (idle connections between requests: 75 s here, longer than client pools
keep theirs), the size limit of a request's headers (``h11_max_incomplete_event_size``: 64 KiB here) and a
per-request concurrency limit, but no read timeouts and no limit on open connections. :class:`GuardedH11Protocol`
adds them:

- **Header timeout** (``--header-timeout``): a client has that long to send a request's complete headers, from
  the moment it connects or sends the first byte of its next request; trickling bytes does not extend it. Then
  it gets a ``408`` and the connection is closed.
- **Body timeout** (``--body-timeout``): once the headers are in, the whole body must arrive within that time
  (a short body, a chunked body that never ends); then a ``408`` (or, if a response was already sent, the
  connection is just closed).
- **Send timeout** (``--send-timeout``): a client that leaves an answer unread for that long — the proxy's send
  buffer full, nothing taken from it — has its connection aborted, and the answer (held in memory, and its
  upstream response) is dropped at once. Each time the client reads enough for the buffer to drain, the clock
  starts again; a stream that is slow to produce events is not affected.
- **Connection limit** (``--max-connections``, lowered to fit the process's open-file limit, see
  :func:`~rag_opt.server.open_files.connection_limit`): a connection over it is answered ``503`` and closed at
  once, so idle connections can never exhaust the file descriptors the proxy needs for its upstream
  connections. The listen backlog — also how many connections the event loop accepts in one go before it can
  refuse any — is the same number, so a burst of connections cannot exhaust them either.
- **Malformed requests** that h11 rejects get an OpenAI-style JSON error: ``414`` for an over-long request line,
  ``431`` for over-large headers, ``400`` otherwise (uvicorn's own answer is plain text).

Every refusal is counted (``ragopt_local_errors_total``) and logged as a warning, which the app's
:class:`~rag_opt.server.logs.RepeatLimiter` keeps from flooding the log.
"""

from __future__ import annotations

import asyncio
import http
import logging
from typing import TYPE_CHECKING, Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from rag_opt.server.errors import error_json
from rag_opt.server.open_files import connection_limit

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.server.metrics import Metrics
    from rag_opt.server.settings import ProxySettings

__all__ = [
    "KEEP_ALIVE_S",
    "MAX_HEADER_BYTES",
    "GuardedH11Protocol",
    "uvicorn_options",
]

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024  # request line and headers
KEEP_ALIVE_S = 75  # longer than client pools keep idle connections (httpx, hence the OpenAI SDKs: 5 s)


def _response(status: int, message: str, code: str, extra: tuple[str, ...] = ()) -> bytes:
    """A complete HTTP/1.1 response with an OpenAI-style error body, closing the connection."""
    body = error_json(message, "invalid_request_error" if status < 500 else "server_error", code)
    head = [
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *extra,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header and body timeouts, a connection limit and JSON errors for malformed
    requests (see the module docstring). The limits are class attributes: :func:`uvicorn_options` makes a
    subclass with the configured values."""

    header_timeout: float = 10.0
    body_timeout: float = 60.0
    send_timeout: float = 60.0
    max_connections: int = 1000
    metrics: Metrics | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind: str | None = None
        self._send_timer: asyncio.TimerHandle | None = None

    # -- the connection's life --------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            logger.warning(
                "%d client connections are open, the limit (--max-connections): refusing new ones with a 503",
                self.max_connections,
            )
            message = f"the proxy has {self.max_connections} connections open, its limit; retry later"
            self._refuse(503, message, "too_many_connections", "too_many_connections", ("retry-after: 1",))
            return
        self._update()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_send()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The transport's buffer is full (the client does not read): the send timeout starts."""
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout, self._send_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_send()

    def _disarm_send(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
        self._send_timer = None

    def _send_expired(self) -> None:
        self._send_timer = None
        logger.warning(
            "a client left an answer unread for %.3g s (--send-timeout): aborting its connection", self.send_timeout
        )
        if self.metrics is not None:
            self.metrics.local_error("send_timeout")
        self.transport.abort()  # (close() would wait for the unread bytes to go); connection_lost follows

    def send_400_response(self, msg: str) -> None:
        """h11 rejected what the client sent: an OpenAI-style error instead of uvicorn's plain text."""
        data = self.conn.trailing_data[0]
        line = data.find(b"\r\n")
        if (line if line >= 0 else len(data)) > MAX_HEADER_BYTES // 2:
            status, message, code = 414, "the request line is too long", "uri_too_long"
        elif b"\r\n\r\n" not in data and len(data) > MAX_HEADER_BYTES:
            status, message = 431, f"the request headers exceed the proxy's limit of {MAX_HEADER_BYTES} bytes"
            code = "headers_too_large"
        else:
            status, message, code = 400, "malformed HTTP request", "invalid_http"
        self._refuse(status, message, code, "invalid_request" if status == 400 else "too_large")

    # -- timeouts -----------------------------------------------------------------------------------------------
    def _update(self) -> None:
        """(Re)arm the timer for what the connection waits for now: headers, a body, or nothing."""
        if self.transport is None or self.transport.is_closing():
            self._disarm()
            return
        state = self.conn.their_state
        if state is h11.IDLE and (self.cycle is None or self.conn.trailing_data[0]):
            self._arm("header", self.header_timeout)  # the first request, or the next one has begun
        elif state is h11.SEND_BODY:
            self._arm("body", self.body_timeout)
        else:  # a whole request is in, or the connection idles between requests (uvicorn's keep-alive timeout)
            self._disarm()

    def _arm(self, kind: str, seconds: float) -> None:
        if self._timer_kind == kind:
            return  # a deadline, not an idle timeout: more bytes do not extend it
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expired, kind)
        self._timer_kind = kind

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_kind = None

    def _expired(self, kind: str) -> None:
        self._timer = None
        self._timer_kind = None
        if self.transport.is_closing():
            return
        seconds, flag = (self.header_timeout, "header") if kind == "header" else (self.body_timeout, "body")
        logger.warning("a client sent no complete request %s within %.3g s: closing its connection", kind, seconds)
        message = f"the request {kind} did not arrive within {seconds:.3g} s (--{flag}-timeout)"
        self._refuse(408, message, "request_timeout", "request_timeout")

    def _refuse(self, status: int, message: str, code: str, kind: str, extra: tuple[str, ...] = ()) -> None:
        """Answer ``status`` (unless a response was sent already) and close the connection; the app, if it is
        handling a request on it, sees the client gone."""
        self._disarm()
        if self.metrics is not None:
            self.metrics.local_error(kind)
        cycle = self.cycle
        if not self.transport.is_closing():
            # a response goes out only where one is due: not in the middle of another one, nor after the answer
            # to a request whose body never finished
            between = self.conn.their_state in (h11.IDLE, h11.ERROR)
            if cycle is None or not cycle.response_started or (cycle.response_complete and between):
                self.transport.write(_response(status, message, code, extra))
            self.transport.close()
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()


def uvicorn_options(settings: ProxySettings, metrics: Metrics | None = None) -> dict[str, Any]:
    """The keyword arguments of ``uvicorn.run`` / ``uvicorn.Config`` for the proxy (besides the app, host and
    port): :class:`GuardedH11Protocol` with the configured limits, the header size limit, the keep-alive
    timeout, the backlog, uvicorn's own access log off (rag-opt's leaves out query strings), no
    ``Server``/``Date`` header (the upstream's are relayed), and uvicorn's ``X-Forwarded-For`` handling off (the
    proxy sets forwarding headers itself: ``--trusted-proxies``)."""
    limit = connection_limit(settings.max_connections)
    if limit < settings.max_connections:
        logger.warning(
            "--max-connections %d does not fit the open-file limit (ulimit -n): at most %d client connections",
            settings.max_connections,
            limit,
        )
    protocol = type(
        "RagOptH11Protocol",
        (GuardedH11Protocol,),
        {
            "header_timeout": settings.header_timeout,
            "body_timeout": settings.body_timeout,
            "send_timeout": settings.send_timeout,
            "max_connections": limit,
            "metrics": metrics,
        },
    )
    return {
        "http": protocol,
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
        "timeout_keep_alive": KEEP_ALIVE_S,
        "access_log": False,
        "server_header": False,
        "date_header": False,
        "proxy_headers": False,
        "backlog": limit,
    }
