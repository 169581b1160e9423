"""The OpenAI-compatible proxy as an ASGI app (Starlette): ``create_app(settings, optimizer=None)``.

``POST /v1/chat/completions`` has its context optimized (see :mod:`rag_opt.adapters.proxy.context`) and is
forwarded; every other ``/v1/...`` request is forwarded unchanged; ``GET /healthz`` and ``GET /metrics``
answer locally. Upstream responses (status, headers, body bytes) are relayed as they arrive, so streamed
server-sent events reach the client chunk by chunk.

Reliability: optimization runs on a bounded worker pool with a bounded queue (:mod:`.pool`), never on the event
loop; a request that fails, exceeds the time budget or finds the optimizer overloaded is forwarded as it came
(fail-open), or answered 429 when configured. Request bodies are size-limited (413), validated (OpenAI-style
400) and parsed off the event loop when large. A client that disconnects cancels its optimization and closes the
upstream request. Security: :mod:`.security` (proxy key, access log, redaction).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
import traceback
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import anyio.to_thread
import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from rag_opt.adapters.proxy.context import ContextPlan, RequestError, plan_request
from rag_opt.adapters.proxy.metrics import CONTENT_TYPE, Metrics
from rag_opt.adapters.proxy.pool import BudgetExceeded, OptimizerPool, Overloaded, retry_after_s
from rag_opt.adapters.proxy.security import (
    Guard,
    body_for_log,
    body_log,
    install_log_filters,
    redact,
    redact_headers,
    too_large_body,
)
from rag_opt.adapters.proxy.settings import ProxySettings

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.types import OptimizeResult

logger = logging.getLogger(__name__)
T = TypeVar("T")

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
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
_WARMUP_QUERY = "What does the proxy load at start-up?"
_WARMUP_DOCS = ["The proxy loads its model at start-up. Then the first request is fast. Nothing else happens."]
INLINE_BYTES = 256 * 1024  # bodies larger than this are parsed / rewritten / validated on a worker thread
VALIDATE_BYTES = 16 * 1024 * 1024  # successful JSON responses up to this size are checked before relaying


class Optimizer(Protocol):
    """What the proxy calls: :meth:`rag_opt.ContextOptimizer.optimize`."""

    def optimize(
        self,
        query: str,
        documents: Sequence[Any],
        *,
        ratio: float | None = None,
        target_tokens: int | None = None,
        threshold: float | None = None,
        ordering: str | None = None,
    ) -> OptimizeResult: ...


def error_response(
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status, headers=headers)


@dataclass
class Outcome:
    """What rag-opt did with one chat request; becomes the ``x-ragopt-*`` response headers."""

    status: str
    tokens_before: int = 0
    tokens_after: int = 0
    optimizer_ms: float = 0.0
    reason: str | None = None  # why it failed open

    def headers(self) -> list[tuple[bytes, bytes]]:
        out = [
            (b"x-ragopt-status", self.status.replace("_", "-").encode()),
            (b"x-ragopt-tokens-before", str(self.tokens_before).encode()),
            (b"x-ragopt-tokens-after", str(self.tokens_after).encode()),
            (b"x-ragopt-optimizer-ms", f"{self.optimizer_ms:.1f}".encode()),
        ]
        if self.reason:
            out.append((b"x-ragopt-reason", self.reason.encode()))
        return out


class BodyTooLarge(Exception):
    """The request body is over ``--max-body-bytes``."""


def _connection_listed(values: list[str]) -> set[str]:
    return {t.strip().lower() for v in values for t in v.split(",") if t.strip()}


async def _off_loop(size: int, fn: Callable[[], T]) -> T:
    """Run ``fn`` inline for small inputs, on a worker thread for large ones (the event loop never stalls)."""
    if size <= INLINE_BYTES:
        return fn()
    return await anyio.to_thread.run_sync(fn)


class _Relay(Response):
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
        state: ProxyState,
        prefix: Sequence[bytes] = (),
        chunks: AsyncIterator[bytes] | None = None,
    ) -> None:
        self.status_code = upstream.status_code
        self.raw_headers = headers
        self.background = None
        self._upstream = upstream
        self._state = state
        self._prefix = prefix
        self._chunks = chunks if chunks is not None else upstream.aiter_raw()
        self._logged: list[bytes] | None = [] if state.settings.log_bodies else None

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
                    redact_headers(self.raw_headers, self._state.secrets),
                    body_for_log(b"".join(self._logged), self._state.secrets),
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
            self._state.metrics.upstream_error("stream")
            logger.warning("upstream response broke off (%s); closing the client connection", type(exc).__name__)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _is_json(body: bytes, encoding: str) -> bool:
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


class ProxyState:
    """Everything one proxy app holds: settings, optimizer, metrics, the upstream client and the worker pool."""

    def __init__(self, settings: ProxySettings, optimizer: Optimizer | None) -> None:
        self.settings = settings
        if optimizer is None:
            from rag_opt.pipeline import ContextOptimizer

            optimizer = ContextOptimizer(
                model=settings.proxy_model,
                target=settings.target,
                device=settings.device,
                dtype=settings.dtype,
                probe=None if settings.probe == "none" else settings.probe,
                ordering=settings.ordering,
                trust_remote_code=settings.trust_remote_code,
            )
        self.optimizer: Optimizer = optimizer
        self.metrics = Metrics()
        self.pool = OptimizerPool(settings.max_concurrency, settings.max_queue, self.metrics, settings.optimizer_nice)
        self.metrics.pool_gauges = self.pool.gauges
        self.metrics.optimizer_state = lambda: self.optimizer_state
        self._client: httpx.AsyncClient | None = None
        self.optimizer_state = "cold"
        self.secrets = tuple(
            k.get_secret_value() for k in (settings.api_key, settings.upstream_api_key) if k is not None
        )

    # -- lifecycle ----------------------------------------------------------------------------------------
    @property
    def client(self) -> httpx.AsyncClient:
        """The one shared upstream client (created on first use, closed at shutdown)."""
        if self._client is None:
            s = self.settings
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(s.read_timeout, connect=s.connect_timeout, pool=s.connect_timeout),
                # idle connections are dropped after 4 s, before common upstream keep-alive timeouts (uvicorn,
                # hence vLLM and others: 5 s): the proxy never sends a request on a connection being closed
                limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=4.0),
                follow_redirects=False,
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        self.pool.shutdown()

    def warm_up(self) -> None:
        """Load the proxy model (runs on the pool at start-up). On failure the proxy serves in pass-through mode."""
        self.optimizer_state = "loading"
        try:
            self.optimizer.optimize(_WARMUP_QUERY, _WARMUP_DOCS, ratio=0.5)
        except Exception as exc:  # the proxy still serves: requests are forwarded unoptimized
            self.optimizer_state = "failed"
            logger.error(
                "the proxy model failed to load (%s: %s): serving in PASS-THROUGH mode, requests are forwarded "
                "unoptimized (GET /healthz says so); fix the model settings and restart",
                type(exc).__name__,
                exc,
            )
        else:
            self.optimizer_state = "ready"
            logger.info("optimizer ready")

    def why(self, exc: BaseException) -> str:
        """An exception for a log line: its type, and its message (which may quote request content) only with
        ``--log-bodies``, redacted; the traceback then at debug level."""
        if not self.settings.log_bodies:
            return type(exc).__name__
        logger.debug("traceback", exc_info=exc)
        return f"{type(exc).__name__}: {redact(str(exc), self.secrets)}"

    @property
    def mode(self) -> str:
        return "pass-through" if self.optimizer_state == "failed" else "optimizing"

    # -- reading requests ---------------------------------------------------------------------------------
    async def read_body(self, request: Request) -> bytes:
        """The request body, at most ``max_body_bytes`` (else :class:`BodyTooLarge`)."""
        limit = self.settings.max_body_bytes
        parts: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge
            parts.append(chunk)
        return b"".join(parts)

    async def _guarded(self, request: Request, route: str, handle: Callable[[bytes], Awaitable[Response]]) -> Response:
        """Read the body, then run ``handle`` until it returns or the client disconnects (which cancels it:
        a waiting optimization is dropped, an upstream request is closed)."""
        self.metrics.request(route)
        try:
            raw = await self.read_body(request)
        except BodyTooLarge:
            self.metrics.local_error("too_large")
            return Response(too_large_body(self.settings.max_body_bytes), 413, media_type="application/json")
        except ClientDisconnect:
            return Response(status_code=499)
        if self.settings.log_bodies:
            body_log.info(
                "request %s %s %s body=%s",
                request.method,
                request.url.path,
                redact_headers(request.headers.raw, self.secrets),
                body_for_log(raw, self.secrets),
            )
        result: Response | None = None
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(watch_disconnect)
            result = await handle(raw)
            tg.cancel_scope.cancel()
        if result is None:  # the client left: nobody reads this
            logger.info("client disconnected before the response started; request abandoned")
            return Response(status_code=499)
        return result

    # -- chat completions ---------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        async def handle(raw: bytes) -> Response:
            prepared = await self._prepare(raw, request)
            if isinstance(prepared, Response):
                return prepared
            body, outcome = prepared
            self.metrics.outcome(outcome.status)
            if self.settings.log_bodies and body != raw:
                body_log.info("forwarded body=%s", body_for_log(body, self.secrets))
            return await self.forward(request, body, outcome.headers())

        return await self._guarded(request, "chat_completions", handle)

    async def _prepare(self, raw: bytes, request: Request) -> tuple[bytes, Outcome] | Response:
        s = self.settings
        headers = request.headers
        try:
            plan = await _off_loop(
                len(raw),
                lambda: plan_request(
                    raw, headers, tag=s.document_tag, tool_messages=s.tool_messages, tool_min_chars=s.tool_min_chars
                ),
            )
        except RequestError as exc:
            self.metrics.outcome("rejected")
            self.metrics.local_error("invalid_request")
            return error_response(400, exc.message, "invalid_request_error", exc.code, exc.param)
        except Exception as exc:  # a bug here must not reach the client
            logger.warning("finding context failed (%s); forwarding the request unchanged", self.why(exc))
            self.metrics.failed_open("error")
            return raw, Outcome("fail_open", reason="error")
        if not plan.options.enabled:
            return await self._render(plan, None), Outcome("disabled")
        if not plan.documents:
            return await self._render(plan, None), Outcome("no_context")
        if plan.query is None:
            return await self._render(plan, None), Outcome("no_query")
        if self.optimizer_state == "failed":
            self.metrics.failed_open("unavailable")
            return await self._render(plan, None), Outcome("fail_open", reason="unavailable")
        t0 = time.perf_counter()
        try:
            result = await self._optimize(plan)
        except Overloaded as exc:
            self.metrics.shed_load(exc.reason)
            if s.on_overload == "reject":
                self.metrics.outcome("overloaded")
                retry = retry_after_s(exc.estimate_s, s.time_budget_ms / 1e3)
                return error_response(
                    429,
                    "rag-opt's optimizer is overloaded; retry later (the proxy runs with --on-overload reject)",
                    "rate_limit_error",
                    "ragopt_overloaded",
                    headers={"retry-after": str(retry)},
                )
            logger.info("optimizer overloaded (%s); forwarding the request unoptimized", exc.reason)
            return await self._fail_open(plan, "overload", t0)
        except BudgetExceeded as exc:
            self.metrics.timed_out(exc.stage)
            logger.warning(
                "optimization exceeded the %.0f ms time budget (%s); forwarding the request unoptimized",
                s.time_budget_ms,
                exc.stage,
            )
            return await self._fail_open(plan, "timeout", t0)
        except Exception as exc:
            logger.warning("optimization failed (%s); forwarding the request unoptimized", self.why(exc))
            return await self._fail_open(plan, "error", t0)
        ms = (time.perf_counter() - t0) * 1e3
        try:
            body = await _off_loop(len(raw), lambda: plan.render(result))
        except Exception as exc:
            logger.warning("writing the optimized context back failed (%s); forwarding unchanged", self.why(exc))
            return await self._fail_open(plan, "error", t0)
        self.metrics.optimization(
            ms / 1e3, result.tokens_before, result.tokens_after, len(plan.documents), len(result.documents)
        )
        return body, Outcome("optimized", result.tokens_before, result.tokens_after, ms)

    async def _fail_open(self, plan: ContextPlan, reason: str, t0: float) -> tuple[bytes, Outcome]:
        self.metrics.failed_open(reason)
        ms = (time.perf_counter() - t0) * 1e3
        return await self._render(plan, None), Outcome("fail_open", optimizer_ms=ms, reason=reason)

    async def _render(self, plan: ContextPlan, result: OptimizeResult | None) -> bytes:
        try:
            return await _off_loop(len(plan.raw), lambda: plan.render(result))
        except Exception as exc:  # pragma: no cover - last resort: the original bytes
            logger.warning("rewriting the request failed (%s); forwarding the original bytes", self.why(exc))
            return plan.raw

    async def _optimize(self, plan: ContextPlan) -> OptimizeResult:
        """Run the optimizer on the pool within the time budget (raises Overloaded / BudgetExceeded / its error)."""
        budget = plan.options.budget(self.settings.budget)
        ordering = plan.options.ordering or self.settings.ordering
        query, docs, optimizer = plan.query or "", plan.optimizer_documents(), self.optimizer

        def job() -> OptimizeResult:
            return optimizer.optimize(query, docs, ordering=ordering, **budget)

        self.metrics.add_in_flight(1)
        try:
            return await self.pool.run(job, self.settings.time_budget_ms / 1e3)
        finally:
            self.metrics.add_in_flight(-1)

    # -- forwarding ---------------------------------------------------------------------------------------
    async def passthrough(self, request: Request) -> Response:
        async def handle(raw: bytes) -> Response:
            return await self.forward(request, raw, [])

        return await self._guarded(request, "passthrough", handle)

    def _upstream_url(self, scope: Scope) -> str:
        raw_path = scope.get("raw_path") or scope["path"].encode()
        path = raw_path.decode("latin-1")
        rest = path[len("/v1") :] if path.startswith("/v1") else path
        query = scope.get("query_string", b"").decode("latin-1")
        return self.settings.upstream + rest + (f"?{query}" if query else "")

    def _request_headers(self, request: Request) -> list[tuple[bytes, bytes]]:
        drop = _NOT_FORWARDED | _connection_listed(request.headers.getlist("connection"))
        key = self.settings.upstream_api_key
        if key is not None:
            drop = drop | {"authorization", "api-key"}
        out = [
            (k, v)
            for k, v in request.headers.raw
            if (n := k.decode("latin-1").lower()) not in drop and not n.startswith("x-ragopt-")
        ]
        if key is not None:
            out.append((b"authorization", f"Bearer {key.get_secret_value()}".encode("latin-1")))
        return out

    async def forward(self, request: Request, body: bytes, extra_headers: list[tuple[bytes, bytes]]) -> Response:
        """Send the request upstream and relay the response as it arrives.

        A successful JSON (not streamed) response is read first and checked: invalid JSON from the upstream is
        a 502 rather than a corrupt answer, and an upstream that fails while sending it a clean 502/504.
        """
        headers = self._request_headers(request)
        sent = {k.decode("latin-1").lower() for k, _ in headers}
        req = self.client.build_request(
            request.method, self._upstream_url(request.scope), headers=headers, content=body or None
        )
        for name in _HTTPX_DEFAULTS:
            if name not in sent and name in req.headers:
                del req.headers[name]
        upstream: httpx.Response | None = None
        try:
            upstream = await self.client.send(req, stream=True)
            chunks = upstream.aiter_raw()
            prefix: list[bytes] = []
            ctype = upstream.headers.get("content-type", "").split(";")[0].strip().lower()
            declared = upstream.headers.get("content-length", "")
            if (
                200 <= upstream.status_code < 300
                and ctype == "application/json"
                and request.method != "HEAD"
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
                    if not await _off_loop(len(whole), functools.partial(_is_json, whole, encoding)):
                        await upstream.aclose()
                        self.metrics.upstream_error("invalid_response")
                        logger.warning("upstream answered %s with invalid JSON (%d bytes)", upstream.status_code, size)
                        return error_response(
                            502,
                            "the upstream LLM server returned an invalid JSON response",
                            "upstream_error",
                            "upstream_invalid_response",
                        )
        except httpx.TimeoutException as exc:
            if upstream is not None:
                await upstream.aclose()
            self.metrics.upstream_error("timeout")
            logger.warning("upstream timed out (%s)", type(exc).__name__)
            return error_response(
                504, "the upstream LLM server did not answer in time", "upstream_error", "upstream_timeout"
            )
        except httpx.HTTPError as exc:
            if upstream is not None:
                await upstream.aclose()
            self.metrics.upstream_error("connect" if upstream is None else "stream")
            logger.warning("upstream failed (%s: %s)", type(exc).__name__, exc)
            return error_response(
                502, "could not reach the upstream LLM server", "upstream_error", "upstream_unavailable"
            )
        except BaseException:  # cancelled (the client left): close the upstream request
            if upstream is not None:
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()
            raise
        self.metrics.upstream_response(upstream.status_code)
        drop = HOP_BY_HOP | _connection_listed(upstream.headers.get_list("connection"))
        out = [(k.lower(), v) for k, v in upstream.headers.raw if k.decode("latin-1").lower() not in drop]
        return _Relay(upstream, out + extra_headers, self, prefix, chunks)

    # -- local endpoints ----------------------------------------------------------------------------------
    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "optimizer": self.optimizer_state, "mode": self.mode})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        msg = f"unknown path {request.url.path}: rag-opt serves /v1/..., /healthz and /metrics"
        return error_response(404, msg, "invalid_request_error", "not_found")
    return error_response(exc.status_code, str(exc.detail), "invalid_request_error", None)


async def _server_error(request: Request, exc: Exception) -> Response:
    # the frames, not the message: it may quote request content
    frames = "".join(traceback.format_tb(exc.__traceback__))
    logger.error("unexpected error (%s) at\n%s", type(exc).__name__, frames)
    return error_response(500, "internal error in the rag-opt proxy", "server_error", None)


def create_app(settings: ProxySettings, optimizer: Optimizer | None = None) -> Starlette:
    """The proxy app. ``optimizer``: anything with ``ContextOptimizer.optimize``'s signature (default: a
    ``ContextOptimizer`` built from ``settings``; the model loads at start-up when ``settings.warmup``).

    ``app.state.ragopt`` is the :class:`ProxyState` (metrics, optimizer, settings, pool).
    """
    state = ProxyState(settings, optimizer)
    install_log_filters()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        _ = state.client
        if settings.warmup:
            state.optimizer_state = "loading"
            state.pool.submit_background(state.warm_up)
        try:
            yield
        finally:
            await state.aclose()

    routes = [
        Route("/healthz", state.healthz, methods=["GET"]),
        Route("/metrics", state.metrics_endpoint, methods=["GET"]),
        Route("/v1/chat/completions", state.chat_completions, methods=["POST"]),
        Route("/v1/{path:path}", state.passthrough, methods=_METHODS),
    ]
    key = settings.api_key.get_secret_value() if settings.api_key is not None else None
    guard = Middleware(
        Guard, api_key=key, max_body_bytes=settings.max_body_bytes, metrics=state.metrics, secrets=state.secrets
    )
    app = Starlette(
        routes=routes,
        middleware=[guard],
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )
    app.state.ragopt = state
    return app
