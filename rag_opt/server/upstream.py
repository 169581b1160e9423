"""Forwarding requests to the upstream LLM servers and relaying their responses.

One shared ``httpx.AsyncClient`` per app, for two upstreams: the Gemini API's paths
(:func:`rag_opt.server.paths.is_gemini_path`: ``/v1beta/...`` and ``/v1/models/{model}:{method}``) go to
``--gemini-upstream`` (the whole path appended to its root URL), every other ``/v1/...`` path to ``--upstream``
(the path below ``/v1`` appended to its base path; :func:`rag_opt.server.paths.upstream_url`). A forwarded
request keeps the client's method, path, query string, headers and body, less hop-by-hop headers,
``Host``/``Content-Length``/``Expect`` (the body was read already), rag-opt's own ``x-ragopt-*`` headers, and the
client's credentials when a configured key replaces them:

- on ``--upstream``'s paths, ``--upstream-api-key`` replaces every one of ``Authorization``, ``api-key``,
  ``x-api-key`` and ``x-goog-api-key``, and is sent as ``x-api-key: <key>`` on Anthropic requests (the Messages
  route, any path under it, and any request with an ``anthropic-version`` header), else as
  ``Authorization: Bearer <key>``;
- on the Gemini API's paths, ``--gemini-upstream-api-key`` replaces the same headers and the ``key`` and
  ``access_token`` query parameters, and is sent as ``x-goog-api-key: <key>``. ``--upstream-api-key`` never
  goes to the Gemini upstream (another host): without ``--gemini-upstream-api-key`` the client's own
  ``x-goog-api-key`` or ``?key=`` travels as it came.

Forwarding headers are the proxy's to set: ``X-Forwarded-For`` names the real
peer (appended to the client's own list only when the peer is one of ``--trusted-proxies``); from other peers,
``X-Forwarded-*``, ``X-Real-IP``, ``Forwarded``, ``CF-Connecting-IP``, ``Client-IP``, ``X-Originating-IP`` and
the like (:data:`FORWARDING_HEADERS`) are removed.

Upstream responses (status, headers, body bytes) are relayed as they arrive (:mod:`rag_opt.server.relay`), so
streamed server-sent events reach the client chunk by chunk; a successful JSON response that is not too large is
checked first, so that an upstream sending invalid JSON becomes a 502 rather than a corrupt answer — except Gemini's
``:streamGenerateContent``, whose stream without ``alt=sse`` is one JSON array sent as ``application/json``:
relayed as it arrives too (:func:`rag_opt.server.paths.is_streamed`). Upstream failures are 502/504 answers in
the route's error shape: ``upstream_unavailable`` when it could not be reached or did not answer HTTP,
``upstream_truncated_response`` when its answer broke off before the end of a body read before relaying (fewer
bytes than its ``Content-Length``); a client that disconnects closes the upstream request.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
from urllib.parse import unquote_to_bytes

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

from rag_opt.server.errors import ErrorFormat, error_response
from rag_opt.server.metrics import Metrics
from rag_opt.server.open_files import connection_limit
from rag_opt.server.paths import MESSAGES_PATH, error_format, is_gemini_path, is_streamed, upstream_url
from rag_opt.server.relay import VALIDATE_BYTES, Relay, is_json, loggable_url
from rag_opt.server.security import redact
from rag_opt.server.settings import ProxySettings
from rag_opt.wire.errors import RequestError
from rag_opt.wire.offload import off_loop

__all__ = [
    "CREDENTIAL_HEADERS",
    "FORWARDING_HEADERS",
    "HOP_BY_HOP",
    "QUERY_CREDENTIALS",
    "Upstream",
    "parse_networks",
    "without_query_credentials",
]

logger = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "expect"}  # the body was read already
_HTTPX_DEFAULTS = ("accept", "accept-encoding", "user-agent")  # httpx adds these; a proxy must not
# forwarding headers: trusted only from --trusted-proxies, else removed (X-Forwarded-For is set from the peer)
FORWARDING_HEADERS = frozenset(
    {
        "forwarded",
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-port",
        "x-forwarded-prefix",
        "x-forwarded-proto",
        "x-forwarded-server",
        "x-forwarded",
        "forwarded-for",
        "x-original-forwarded-for",
        "x-real-ip",
        "x-client-ip",
        "client-ip",
        "true-client-ip",
        "x-cluster-client-ip",
        "cf-connecting-ip",
        "cf-connecting-ipv6",
        "fastly-client-ip",
        "x-originating-ip",
        "x-remote-ip",
        "x-remote-addr",
        "x-envoy-external-address",
        "x-original-url",
        "x-rewrite-url",
    }
)
# the client's credentials: all of them replaced by --upstream-api-key when one is set (the upstream gets one key)
CREDENTIAL_HEADERS = frozenset({"authorization", "api-key", "x-api-key", "x-goog-api-key"})
QUERY_CREDENTIALS = frozenset({b"key", b"access_token"})  # Google's: replaced by --gemini-upstream-api-key


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(spec: str | None) -> tuple[Network, ...]:
    """``"10.0.0.1, 192.168.0.0/16"`` -> networks (a bare address is a /32 or /128); ValueError when invalid."""
    return tuple(ipaddress.ip_network(p.strip(), strict=False) for p in (spec or "").split(",") if p.strip())


def _trusted(peer: str | None, networks: tuple[Network, ...]) -> bool:
    if peer is None or not networks:
        return False
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    return any(address in n for n in networks)


def _anthropic(request: Request) -> bool:
    """Whether a request is for Anthropic's API: under ``/v1/messages``, or with an ``anthropic-version``."""
    path = request.scope["path"]
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/") or "anthropic-version" in request.headers


def without_query_credentials(query: bytes) -> bytes:
    """``query`` without its :data:`QUERY_CREDENTIALS` parameters (names percent-decoded, any letter case); the
    other parameters as they came."""
    if not query:
        return query

    def name(param: bytes) -> bytes:
        return unquote_to_bytes(param.split(b"=", 1)[0].replace(b"+", b" ")).strip().lower()

    return b"&".join(p for p in query.split(b"&") if name(p) not in QUERY_CREDENTIALS)


def _connection_listed(values: list[str]) -> set[str]:
    return {t.strip().lower() for v in values for t in v.split(",") if t.strip()}


class Upstream:
    """The upstream LLM server of one app: its client (created on first use, closed by :meth:`aclose`) and
    :meth:`forward`."""

    def __init__(self, settings: ProxySettings, metrics: Metrics, secrets: tuple[str, ...]) -> None:
        self.settings = settings
        self.metrics = metrics
        self.secrets = secrets
        self.base = httpx.URL(settings.upstream)
        self.gemini_base = httpx.URL(settings.gemini_upstream)
        self.trusted = parse_networks(settings.trusted_proxies)
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        """The one shared upstream client."""
        if self._client is None:
            s = self.settings
            most = connection_limit(s.max_connections)  # one upstream connection per client connection at most
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(s.read_timeout, connect=s.connect_timeout, pool=s.connect_timeout),
                # idle connections are dropped after 4 s, before common upstream keep-alive timeouts (uvicorn,
                # hence vLLM and others: 5 s): the proxy never sends a request on a connection being closed
                limits=httpx.Limits(
                    max_connections=most, max_keepalive_connections=min(100, most), keepalive_expiry=4.0
                ),
                follow_redirects=False,
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def url(self, scope: Scope) -> httpx.URL:
        """The upstream URL of a request: the upstream base URL, the path below ``/v1`` and the query string; on
        the Gemini API's paths the Gemini root URL, the whole path and the query string (its credentials removed
        when ``--gemini-upstream-api-key`` replaces them) (:func:`rag_opt.server.paths.upstream_url`;
        RequestError if it would leave the base)."""
        raw_path = scope.get("raw_path") or scope["path"].encode("utf-8")
        query = scope.get("query_string", b"")
        if not is_gemini_path(scope["path"]):
            return upstream_url(self.base, raw_path, query)
        if self.settings.gemini_upstream_api_key is not None:
            query = without_query_credentials(query)
        return upstream_url(self.gemini_base, raw_path, query, below=b"")

    def request_headers(
        self, request: Request, drop_extra: frozenset[str] = frozenset(), key_header: str = "authorization"
    ) -> list[tuple[bytes, bytes]]:
        """The headers to forward (see the module docstring); ``drop_extra``: more names not to forward;
        ``key_header``: where ``--upstream-api-key`` goes (``authorization`` as a bearer token, or ``x-api-key``;
        on the Gemini API's paths ``--gemini-upstream-api-key`` goes as ``x-goog-api-key``)."""
        drop = _NOT_FORWARDED | {"x-forwarded-for"} | drop_extra  # X-Forwarded-For: set below
        drop = drop | _connection_listed(request.headers.getlist("connection"))
        key = self.settings.upstream_api_key
        if is_gemini_path(request.scope["path"]):
            key, key_header = self.settings.gemini_upstream_api_key, "x-goog-api-key"
        if key is not None:
            drop = drop | CREDENTIAL_HEADERS | {key_header}
            if key_header == "authorization" and _anthropic(request):
                key_header = "x-api-key"
        client = request.scope.get("client")
        peer = client[0] if client else None
        trusted = _trusted(peer, self.trusted)
        if not trusted:
            drop = drop | FORWARDING_HEADERS
        out = [
            (k, v)
            for k, v in request.headers.raw
            if (n := k.decode("latin-1").lower()) not in drop and not n.startswith("x-ragopt-")
        ]
        if peer is not None:
            chain = [v.decode("latin-1").strip() for k, v in request.headers.raw if k.lower() == b"x-forwarded-for"]
            chain = [c for c in chain if c] if trusted else []
            out.append((b"x-forwarded-for", ", ".join([*chain, peer]).encode("latin-1")))
        if key is not None:
            value = key.get_secret_value() if key_header != "authorization" else f"Bearer {key.get_secret_value()}"
            out.append((key_header.encode("latin-1"), value.encode("latin-1")))
        return out

    async def forward(
        self,
        request: Request,
        body: bytes,
        extra_headers: list[tuple[bytes, bytes]],
        drop_headers: frozenset[str] = frozenset(),
        *,
        fmt: ErrorFormat | None = None,
        key_header: str = "authorization",
    ) -> Response:
        """Send the request upstream with ``body`` and relay the response as it arrives, with ``extra_headers``
        (``drop_headers``: request headers not to forward, e.g. ``content-encoding`` of a body decoded here;
        ``fmt``: the shape of rag-opt's own error answers, by default the path's; ``key_header``: see
        :meth:`request_headers`).

        A successful JSON (not streamed) response is read first and checked: invalid JSON from the upstream is
        a 502 rather than a corrupt answer, and an upstream that fails while sending it a clean 502/504.
        """
        fmt = fmt if fmt is not None else error_format(request.scope["path"])
        headers = self.request_headers(request, drop_headers, key_header)
        sent = {k.decode("latin-1").lower() for k, _ in headers}
        try:
            url = self.url(request.scope)
            req = self.client.build_request(request.method, url, headers=headers, content=body or None)
        except (RequestError, httpx.InvalidURL) as exc:
            message = exc.message if isinstance(exc, RequestError) else "invalid request path: it is not a valid URL"
            return error_response(400, message, "invalid_request_error", "invalid_path", fmt=fmt)
        for name in _HTTPX_DEFAULTS:
            if name not in sent and name in req.headers:
                del req.headers[name]
        upstream: httpx.Response | None = None
        prefix: list[bytes] = []
        declared = ""
        try:
            upstream = await self.client.send(req, stream=True)
            chunks = upstream.aiter_raw()
            ctype = upstream.headers.get("content-type", "").split(";")[0].strip().lower()
            declared = upstream.headers.get("content-length", "").strip()
            if (
                200 <= upstream.status_code < 300
                and ctype == "application/json"
                and request.method != "HEAD"
                and not is_streamed(request.scope["path"])
                and (not declared.isdigit() or int(declared) <= VALIDATE_BYTES)
            ):
                size = 0
                async for chunk in chunks:
                    prefix.append(chunk)
                    size += len(chunk)
                    if size > VALIDATE_BYTES:
                        break
                else:  # the whole body: check it
                    whole = b"".join(prefix)
                    encoding = upstream.headers.get("content-encoding", "").strip().lower()
                    if not await off_loop(len(whole), functools.partial(is_json, whole, encoding)):
                        await upstream.aclose()
                        self.metrics.upstream_error("invalid_response")
                        logger.warning(
                            "upstream %s answered %s with invalid JSON (%d bytes)",
                            loggable_url(url),
                            upstream.status_code,
                            size,
                        )
                        return error_response(
                            502,
                            "the upstream LLM server returned an invalid JSON response",
                            "upstream_error",
                            "upstream_invalid_response",
                            fmt=fmt,
                        )
        except httpx.TimeoutException as exc:
            if upstream is not None:
                await upstream.aclose()
            self.metrics.upstream_error("timeout")
            logger.warning("upstream timed out: %s (%s)", loggable_url(url), type(exc).__name__)
            return error_response(
                504, "the upstream LLM server did not answer in time", "upstream_error", "upstream_timeout", fmt=fmt
            )
        except httpx.HTTPError as exc:
            if upstream is not None:  # it answered, then its body broke off: a truncated answer, nothing relayed
                await upstream.aclose()
                self.metrics.upstream_error("stream")
                received = sum(map(len, prefix))
                logger.warning(
                    "upstream %s: answer %s broke off after %d bytes%s (%s: %s)",
                    loggable_url(url),
                    upstream.status_code,
                    received,
                    f" of the {declared} it declared" if declared.isdigit() else "",
                    type(exc).__name__,
                    redact(str(exc), self.secrets),
                )
                return error_response(
                    502,
                    f"the upstream LLM server's answer was truncated: it broke off after {received} bytes"
                    + (f" of the {declared} its Content-Length declared" if declared.isdigit() else ""),
                    "upstream_error",
                    "upstream_truncated_response",
                    fmt=fmt,
                )
            self.metrics.upstream_error("connect")
            logger.warning(
                "upstream failed: %s could not be reached (%s: %s)",
                loggable_url(url),
                type(exc).__name__,
                redact(str(exc), self.secrets),
            )
            return error_response(
                502, "could not reach the upstream LLM server", "upstream_error", "upstream_unavailable", fmt=fmt
            )
        except BaseException:  # cancelled (the client left): close the upstream request
            if upstream is not None:
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()
            raise
        self.metrics.upstream_response(upstream.status_code)
        drop = HOP_BY_HOP | _connection_listed(upstream.headers.get_list("connection"))
        out = [(k.lower(), v) for k, v in upstream.headers.raw if k.decode("latin-1").lower() not in drop]
        return Relay(
            upstream, out + extra_headers, self.metrics, self.secrets, self.settings.log_bodies, prefix, chunks
        )
