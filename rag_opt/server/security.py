"""The proxy's front door: the optional proxy access key, the request size limit and the access log.

The proxy key (``--api-key`` / ``RAG_OPT_API_KEY``, at least :data:`~rag_opt.server.settings_checks.MIN_PROXY_KEY_CHARS`
characters) is accepted as ``X-RagOpt-Api-Key: <key>``, as ``Authorization: Bearer <key>``, as
``X-Headroom-Proxy-Token: <key>`` (the header Headroom's proxy reads its ``HEADROOM_PROXY_TOKEN`` from besides
``Authorization: Bearer``, so a gateway's Headroom guardrail that sends its proxy token there needs no other
header), and on the Gemini API's paths (:func:`rag_opt.server.paths.is_gemini_path`) also as
``x-goog-api-key: <key>`` or ``?key=<key>``, where the Gemini SDK sends its ``api_key`` (so a client holding only
the proxy key needs no other header; the Gemini key is then the proxy's ``--gemini-upstream-api-key``); each is
compared in constant time (:func:`hmac.compare_digest`), and any one that matches lets the request in (a client
may send its provider's key in ``Authorization`` and the proxy key in a header of its own) — but
``X-RagOpt-Api-Key`` and ``X-Headroom-Proxy-Token``, which carry nothing but the proxy key, must agree when both
are sent (one wrong is a 401). The key never reaches the upstream: those two headers are always removed, and so
is every other header that carries the proxy key anywhere in its name or value — as it is,
percent-encoded, in hexadecimal or in base64 (standard or URL-safe, padded or not, at any offset: ``Basic``
credentials, ``Authorization: Token <key>``, ``Bearer<TAB><key>``, ``api-key: <key>``...; percent-encoded
any number of times over) — and every query parameter that carries it (``?api_key=<key>``); the upstream then
gets ``--upstream-api-key`` when one is configured, else no ``Authorization``. ``GET /healthz``, ``/livez``,
``/readyz`` and ``/health`` are open (probes; they say nothing but the proxy's state); everything else,
``/metrics`` included, needs the key when one is set.

Before that, every request's path is checked (:func:`rag_opt.server.paths.check_path`: 414 when too long, 400
when not plain), a request that declares both ``Transfer-Encoding`` and ``Content-Length`` (a smuggling
pattern) is answered 400 and its connection closed, a request that sends a credential header the proxy reads
(:data:`SINGLE_HEADERS`: ``Authorization``, ``X-RagOpt-Api-Key``, ``X-Headroom-Proxy-Token``, ``x-api-key``,
``api-key``, ``x-goog-api-key``) more than once is answered 400 (``duplicate_header``: which one counts would be
a guess, and the upstream might guess otherwise), and, except on the probes, one whose ``Host`` the proxy
does not answer to or that a browser sent cross-origin is answered 403 (:mod:`rag_opt.server.browser`: DNS
rebinding, CSRF). After the key check, a body declared as anything but JSON on a JSON route is a 415.

Credentials are never logged: the access log has the method, the path without its query string (where
``?key=`` travels), the status and the time (a path cut at 200 characters); request and response bodies are
logged only with ``--log-bodies``, and then redacted (:mod:`rag_opt.server.redaction`, whose names
:func:`redact`, :func:`redact_headers`, :func:`body_for_log`, :data:`body_log`, :func:`install_log_filters`,
:data:`SENSITIVE_HEADERS` and :data:`LOG_BODY_LIMIT` this module re-exports).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import re
import time
from collections.abc import Iterable
from urllib.parse import unquote_to_bytes

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rag_opt.server.browser import HostPolicy, check_browser, check_content_type
from rag_opt.server.errors import ErrorFormat, error_json
from rag_opt.server.metrics import Metrics
from rag_opt.server.paths import check_path, error_format, is_gemini_path, takes_json
from rag_opt.server.redaction import (
    LOG_BODY_LIMIT,
    SENSITIVE_HEADERS,
    body_for_log,
    body_log,
    install_log_filters,
    redact,
    redact_headers,
)
from rag_opt.wire.errors import RequestError

__all__ = [
    "GOOGLE_KEY_HEADER",
    "HEADROOM_KEY_HEADER",
    "KEY_HEADER",
    "LOG_BODY_LIMIT",
    "LOG_PATH_LIMIT",
    "OPEN_PATHS",
    "OWN_KEY_HEADERS",
    "SENSITIVE_HEADERS",
    "SINGLE_HEADERS",
    "Guard",
    "access_log",
    "body_for_log",
    "body_log",
    "install_log_filters",
    "redact",
    "redact_headers",
    "too_large_body",
]

access_log = logging.getLogger("rag_opt.server.access")

KEY_HEADER = b"x-ragopt-api-key"
# Headroom's proxy-token header (HEADROOM_PROXY_TOKEN), where a gateway's Headroom guardrail may send its token
HEADROOM_KEY_HEADER = b"x-headroom-proxy-token"
OWN_KEY_HEADERS = (KEY_HEADER, HEADROOM_KEY_HEADER)  # they carry only the proxy key: always removed, never forwarded
GOOGLE_KEY_HEADER = b"x-goog-api-key"  # where the Gemini SDK sends its api_key (also ?key=)
OPEN_PATHS = frozenset({"/healthz", "/livez", "/readyz", "/health"})
LOG_PATH_LIMIT = 200  # characters of a path in the access log
# credential headers the proxy reads (the proxy key, the tenant): sent more than once, a request is refused
SINGLE_HEADERS = frozenset({b"authorization", *OWN_KEY_HEADERS, b"x-api-key", b"api-key", GOOGLE_KEY_HEADER})


class Guard:
    """ASGI middleware in front of the proxy app: key check, size limit on the declared length, access log."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: int,
        metrics: Metrics,
        secrets: tuple[str, ...],
        hosts: HostPolicy | None = None,
    ) -> None:
        self.app = app
        self.key = api_key.encode("utf-8") if api_key else None
        self.forms = _encoded_forms(self.key) if self.key else ()
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.secrets = secrets
        self.hosts = hosts if hosts is not None else HostPolicy.build("127.0.0.1")

    def authorize(
        self, headers: list[tuple[bytes, bytes]], query: bytes | None = None
    ) -> tuple[bool, list[tuple[bytes, bytes]]]:
        """(authorized, the headers without the proxy key). Without a configured key everyone is authorized.
        ``query``: the query string of a request on the Gemini API's paths, whose ``x-goog-api-key`` header and
        ``key`` parameter may carry the proxy key too (None: elsewhere, they are not read)."""
        # X-RagOpt-Api-Key, X-Headroom-Proxy-Token, Bearer, x-goog-api-key, ?key=
        presented: list[bytes | None] = [None] * 5
        for k, v in headers:
            name = k.lower()
            if name in OWN_KEY_HEADERS:
                presented[OWN_KEY_HEADERS.index(name)] = v.strip()
            elif name == b"authorization":
                scheme, _, cred = v.strip().partition(b" ")
                if scheme.lower() == b"bearer":
                    presented[2] = cred.strip()
            elif name == GOOGLE_KEY_HEADER and query is not None:
                presented[3] = v.strip()
        for param in (query or b"").split(b"&"):
            name, _, value = param.partition(b"=")
            if name == b"key":
                presented[4] = unquote_to_bytes(value.replace(b"+", b" "))
        key = self.key
        matched = [False] * len(presented)
        if key is not None:
            # all compared, each in constant time: no early exit reveals which one (or how much) matched
            matched = [hmac.compare_digest(p or b"", key) and p is not None for p in presented]
        # the two headers of the proxy key alone, both sent, must both hold it (which one counts would be a guess)
        disagree = presented[0] is not None and presented[1] is not None and not (matched[0] and matched[1])
        ok = key is None or (any(matched) and not disagree)
        # (searched only once authorized: an unauthorized request is never forwarded, and learns no timing)
        strip = key is not None and ok
        kept = [(k, v) for k, v in headers if k.lower() not in OWN_KEY_HEADERS and not (strip and self.carries(k, v))]
        return ok, kept

    def carries(self, *parts: bytes) -> bool:
        """Whether any of ``parts`` (a header's name and value, a query parameter) carries the proxy key: as it
        is, percent-encoded (any number of times over), in hexadecimal, in base64 (either alphabet, any padding
        or offset) or inside Basic credentials."""
        if self.key is None:
            return False
        texts = [t for p in parts for t in _decodings(p)]
        if any(form in text for text in texts for form in self.forms):
            return True
        for text in texts:
            scheme, _, cred = text.strip().partition(b" ")
            if scheme.lower() == b"basic":
                cred = cred.strip()
                try:
                    if self.key in base64.b64decode(cred + b"=" * (-len(cred) % 4), validate=False):
                        return True
                except (binascii.Error, ValueError):
                    pass
        return False

    def strip_query(self, query: bytes) -> bytes:
        """The query string without the parameters that carry the proxy key."""
        if self.key is None or not query:
            return query
        return b"&".join(p for p in query.split(b"&") if not self.carries(p))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [0]

        async def send_logged(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, send_logged)
        finally:
            client = scope.get("client")
            path = scope["path"]
            if len(path) > LOG_PATH_LIMIT:
                path = f"{path[:LOG_PATH_LIMIT]}...({len(path)} characters)"
            access_log.info(
                "%s %s %s %s %.1fms",
                client[0] if client else "-",
                scope["method"],
                path,  # never the query string: it may carry credentials
                status[0] or "-",
                (time.perf_counter() - t0) * 1e3,
            )

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        fmt = error_format(scope["path"])  # Anthropic's error shape on its route
        try:
            check_path(scope.get("raw_path") or scope["path"].encode("utf-8"), scope["path"])
        except RequestError as exc:
            self.metrics.local_error("too_large" if exc.status == 414 else "invalid_request")
            await _send_json(
                send, exc.status, error_json(exc.message, "invalid_request_error", exc.code, fmt, exc.status)
            )
            return
        names = {k.lower() for k, _ in scope["headers"]}
        if b"transfer-encoding" in names and b"content-length" in names:
            self.metrics.local_error("invalid_request")
            body = error_json(
                "the request has both Transfer-Encoding and Content-Length: send one of them",
                "invalid_request_error",
                "invalid_framing",
                fmt,
            )
            await _send_json(send, 400, body, [(b"connection", b"close")])  # and close the connection
            return
        repeated = _repeated(scope["headers"], SINGLE_HEADERS)
        if repeated is not None:
            self.metrics.local_error("invalid_request")
            body = error_json(
                f"the request has more than one {repeated} header: send it once",
                "invalid_request_error",
                "duplicate_header",
                fmt,
            )
            await _send_json(send, 400, body)
            return
        if scope["path"] not in OPEN_PATHS:  # DNS rebinding, cross-origin browser requests
            refused = check_browser(scope["headers"], self.hosts)
            if refused is not None:
                self.metrics.local_error("forbidden")
                await _send_json(
                    send, refused[0], error_json(refused[1], "invalid_request_error", refused[2], fmt, refused[0])
                )
                return
        gemini = is_gemini_path(scope["path"])
        query = scope.get("query_string", b"")
        ok, headers = self.authorize(list(scope["headers"]), query if gemini else None)
        scope = {**scope, "headers": headers, "query_string": self.strip_query(query) if ok else query}
        if not ok and scope["path"] not in OPEN_PATHS:
            self.metrics.local_error("unauthorized")
            body = error_json(
                "missing or incorrect rag-opt proxy key: send it as 'Authorization: Bearer <key>', "
                "'X-RagOpt-Api-Key: <key>' or 'X-Headroom-Proxy-Token: <key>'"
                + (" (or as 'x-goog-api-key: <key>', the Gemini SDK's api_key)" if gemini else ""),
                "invalid_request_error",
                "invalid_api_key",
                fmt,
                401,
            )
            await _send_json(send, 401, body, [(b"www-authenticate", b'Bearer realm="rag-opt"')])
            return
        declared = [v for k, v in headers if k.lower() == b"content-length"]
        if declared:
            try:
                length = int(declared[-1])
                if length < 0:
                    raise ValueError
            except ValueError:
                self.metrics.local_error("invalid_request")
                body = error_json("invalid Content-Length header", "invalid_request_error", "invalid_request", fmt)
                await _send_json(send, 400, body)
                return
            if length > self.max_body_bytes:
                self.metrics.local_error("too_large")
                await _send_json(send, 413, too_large_body(self.max_body_bytes, fmt))
                return
        if scope["method"] == "POST" and takes_json(scope["path"]):  # a form or text/plain: a browser's CSRF
            refused = check_content_type(headers)
            if refused is not None:
                self.metrics.local_error("invalid_request")
                await _send_json(
                    send, refused[0], error_json(refused[1], "invalid_request_error", refused[2], fmt, refused[0])
                )
                return
        await self.app(scope, receive, send)


_DECODE_ROUNDS = 4  # percent-decodings of a header or parameter searched for the proxy key (%4B, %254B, ...)


_UNICODE_ESCAPE = re.compile(rb"(?:%u|\\u)([0-9A-Fa-f]{4})")  # %u004B (JavaScript's escape()), \u004B (JSON)


def _decodings(part: bytes) -> list[bytes]:
    """``part`` as it is and percent-decoded once, twice... (``+`` as a space; ``%uXXXX`` and ``\\uXXXX``
    escapes too), until nothing changes (at most :data:`_DECODE_ROUNDS` times)."""
    out = [part]
    for _ in range(_DECODE_ROUNDS):
        last = out[-1]
        if b"%" not in last and b"+" not in last and b"\\u" not in last:
            break
        decoded = _UNICODE_ESCAPE.sub(_unicode_char, last) if b"u" in last else last
        decoded = unquote_to_bytes(decoded.replace(b"+", b" "))
        if decoded == last:
            break
        out.append(decoded)
    return out


def _unicode_char(m: re.Match[bytes]) -> bytes:
    return chr(int(m.group(1), 16)).encode("utf-8", "surrogatepass")


def _encoded_forms(key: bytes) -> tuple[bytes, ...]:
    """The proxy key as it may appear inside a header or a query: as it is, in hexadecimal, and the part of its
    base64 encoding (standard and URL-safe) that does not depend on what precedes it, for each of the three
    offsets it can start at in a longer base64 text (``Basic base64(user:key)``)."""
    forms = {key, key.hex().encode(), key.hex().upper().encode()}
    for shift in range(3):
        encoded = base64.b64encode(b"\0" * shift + key)
        first, end = -(-shift * 8 // 6), (shift + len(key)) * 8 // 6  # the characters made of the key's bits alone
        core = encoded[first:end]
        forms |= {core, core.translate(_URLSAFE)}
    return tuple(f for f in forms if f)


_URLSAFE = bytes.maketrans(b"+/", b"-_")


def _repeated(headers: Iterable[tuple[bytes, bytes]], names: frozenset[bytes]) -> str | None:
    """The first of ``names`` (lower case) that ``headers`` hold more than once, else None."""
    seen: set[bytes] = set()
    for k, _ in headers:
        name = k.lower()
        if name in names:
            if name in seen:
                return name.decode("latin-1")
            seen.add(name)
    return None


def too_large_body(limit: int, fmt: ErrorFormat = "openai") -> bytes:
    """The 413 answer's body."""
    return error_json(
        f"the request body exceeds the proxy's limit of {limit} bytes (--max-body-bytes)",
        "invalid_request_error",
        "request_too_large",
        fmt,
        413,
    )


async def _send_json(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})
