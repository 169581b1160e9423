"""The OpenAI-compatible proxy as an ASGI app (Starlette): ``create_app(settings, optimizer=None)``.

``POST /v1/chat/completions``, ``POST /v1/messages`` (the Anthropic Messages API), ``POST /v1/responses`` (the
OpenAI Responses API) and ``POST /v1beta/models/{model}:generateContent`` / ``:streamGenerateContent`` (the Gemini
API; also under ``tunedModels/`` and ``/v1``: :func:`rag_opt.server.paths.gemini_route`) have their context
optimized (:mod:`rag_opt.server.routes`: each API's planner from :mod:`rag_opt.wire` in
:mod:`rag_opt.server.flow`, its tiers in :mod:`rag_opt.server.engine`) and are forwarded; ``POST /v1/compress``
answers optimized documents as JSON (:mod:`rag_opt.server.compress`, through the same engine; its schema at
``GET /v1/compress/schema``); every other ``/v1/...`` request is forwarded unchanged to ``--upstream``, and every
other ``/v1beta/...`` request (and the other model methods of Gemini's v1 API, ``/v1/models/{model}:countTokens``...)
to ``--gemini-upstream`` (:mod:`rag_opt.server.upstream`); ``GET /livez`` (the process is up),
``GET /readyz`` and ``GET /health`` (503 until the proxy model has loaded or pass-through mode is settled),
``GET /healthz`` (always 200, with the optimizer's state), ``GET /metrics`` (Prometheus) and ``GET /stats`` (JSON
totals) answer locally. No
redirect is ever built from the client's ``Host``: a path with a trailing slash is refused, not redirected; and
the optimized paths and ``/v1/compress`` take ``POST`` only, ``/v1/compress/schema`` ``GET`` only (another method is a
405, never forwarded unvalidated). rag-opt's own
error answers are OpenAI-style, except on ``/v1/messages`` (Anthropic's shape) and on the Gemini API's paths
(Google's shape: :func:`rag_opt.server.paths.error_format`).

Reliability: optimization runs on a bounded worker pool with a bounded queue (:mod:`rag_opt.server.pool`), never
on the event loop; a request that fails, exceeds the time budget or finds the optimizer overloaded is forwarded
as it came (fail-open), or answered 429 when configured. Request bodies are size-limited (413), validated
(OpenAI-style 400) and parsed off the event loop when large. A client that disconnects cancels its optimization
and closes the upstream request. The proxy model loads at start-up on the pool; if it fails to load, the proxy
serves in pass-through mode. Security: :mod:`rag_opt.server.security` (paths, proxy key, access log,
redaction); connections: :mod:`rag_opt.server.http` (read timeouts, connection limit). An unexpected error is a
500 whose log line has the exception's type and frames, never its message (it may quote request content), and
repeated warnings are rate-limited (:mod:`rag_opt.server.logs`).
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from rag_opt.server.browser import HostPolicy
from rag_opt.server.compress import Compressor
from rag_opt.server.engine import Engine
from rag_opt.server.errors import BodyTooLarge, error_response
from rag_opt.server.flow import ContextFlow
from rag_opt.server.logs import RepeatLimiter, limit_repeats
from rag_opt.server.metrics import CONTENT_TYPE
from rag_opt.server.paths import (
    CHAT_PATH,
    GEMINI_PREFIX,
    MESSAGES_PATH,
    OPTIMIZED_PATHS,
    RESPONSES_PATH,
    error_format,
    gemini_route,
)
from rag_opt.server.routes import AnthropicMessages, ChatCompletions, GeminiContent, Responses
from rag_opt.server.security import Guard, body_for_log, body_log, install_log_filters, redact_headers, too_large_body
from rag_opt.server.settings import ProxySettings
from rag_opt.server.state import Optimizer, ProxyState
from rag_opt.wire.compress import compress_schema
from rag_opt.wire.compress_protocol import COMPRESS_PATH, SCHEMA_PATH

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
_WARMUP_QUERY = "What does the proxy load at start-up?"
_WARMUP_DOCS = ["The proxy loads its model at start-up. Then the first request is fast. Nothing else happens."]


def _warm_up(state: ProxyState) -> None:
    """Load the proxy model (runs on the pool at start-up). On failure the proxy serves in pass-through mode."""
    state.optimizer_state = "loading"
    state.targets.preload()  # the target tokenizers a request may name (failures logged)
    try:
        state.optimizer.optimize(_WARMUP_QUERY, _WARMUP_DOCS, ratio=0.5)
        if state.lexical_tier:  # its probe too: when it steps in for a slow first request, it has a tenth of the budget
            state.optimizer.lexical_scorer()  # type: ignore[attr-defined]
    except Exception as exc:  # the proxy still serves: requests are forwarded unoptimized
        state.optimizer_state = "failed"
        logger.error(
            "the proxy model failed to load (%s: %s): serving in PASS-THROUGH mode, requests are forwarded "
            "unoptimized (GET /healthz says so); fix the model settings and restart",
            type(exc).__name__,
            exc,
        )
    else:
        state.optimizer_state = "ready"
        logger.info("optimizer ready")


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, at most ``limit`` bytes (else :class:`~rag_opt.server.errors.BodyTooLarge`)."""
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        parts.append(chunk)
    return b"".join(parts)


async def _guarded(
    state: ProxyState, request: Request, route: str, handle: Callable[[bytes], Awaitable[Response]]
) -> Response:
    """Read the body, then run ``handle`` until it returns or the client disconnects (which cancels it:
    a waiting optimization is dropped, an upstream request is closed)."""
    state.metrics.request(route)
    try:
        raw = await _read_body(request, state.settings.max_body_bytes)
    except BodyTooLarge:
        state.metrics.local_error("too_large")
        body = too_large_body(state.settings.max_body_bytes, error_format(request.url.path))
        return Response(body, 413, media_type="application/json")
    except ClientDisconnect:
        return Response(status_code=499)
    if state.settings.log_bodies:
        body_log.info(
            "request %s %s %s body=%s",
            request.method,
            request.url.path,
            redact_headers(request.headers.raw, state.secrets),
            body_for_log(raw, state.secrets),
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


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    fmt = error_format(request.url.path)
    if exc.status_code == 404:
        msg = (
            "unknown path: rag-opt serves /v1/..., /v1beta/... (the Gemini API), /livez, /readyz, /health, "
            "/healthz, /metrics and /stats"
        )
        return error_response(404, msg, "invalid_request_error", "not_found", fmt=fmt)
    return error_response(exc.status_code, str(exc.detail), "invalid_request_error", None, fmt=fmt)


def _innermost(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (a task group wraps what its task raised)."""
    inner = getattr(exc, "exceptions", None)  # (BaseExceptionGroup, or its backport before Python 3.11)
    while isinstance(inner, (list, tuple)) and inner and isinstance(inner[0], BaseException):
        exc = inner[0]
        inner = getattr(exc, "exceptions", None)
    return exc


async def _server_error(request: Request, exc: Exception) -> Response:
    # the type and frames, not the message: it may quote request content
    leaf = _innermost(exc)
    frames = "".join(traceback.format_tb(leaf.__traceback__))
    logger.error("unexpected error (%s) at\n%s", type(leaf).__name__, frames)
    fmt = error_format(request.url.path)
    return error_response(500, "internal error in the rag-opt proxy", "server_error", None, fmt=fmt)


class _ProxyApp(Starlette):
    """Starlette re-raises an unexpected error after answering it, for the server to log: uvicorn would log it
    with its message. It was logged (:func:`_server_error`) and answered already, so it stops here."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # the lifespan: its failures are uvicorn's to report
            await super().__call__(scope, receive, send)
            return
        try:
            await super().__call__(scope, receive, send)
        except Exception:  # noqa: BLE001 - answered and logged (type and frames) by _server_error
            pass


def create_app(settings: ProxySettings, optimizer: Optimizer | None = None) -> Starlette:
    """The proxy app. ``optimizer``: anything with ``ContextOptimizer.optimize``'s signature (default: a
    ``ContextOptimizer`` built from ``settings``; the model loads at start-up when ``settings.warmup``).

    ``app.state.ragopt`` is the :class:`~rag_opt.server.state.ProxyState` (metrics, optimizer, settings, pool,
    upstream).
    """
    state = ProxyState(settings, optimizer)
    engine = Engine(state)  # one set of tiers (pool, lexical tier) for every route that optimizes
    flows: dict[str, tuple[str, ContextFlow]] = {  # path: (the route's metrics label, its flow)
        CHAT_PATH: ("chat_completions", ChatCompletions(state, engine)),
        MESSAGES_PATH: ("messages", AnthropicMessages(state, engine)),
        RESPONSES_PATH: ("responses", Responses(state, engine)),
    }
    gemini = GeminiContent(state, engine)  # its paths name the model: found by gemini_route
    compressor = Compressor(state, engine)
    local_methods = {  # never forwarded
        **dict.fromkeys(OPTIMIZED_PATHS, "POST"),
        COMPRESS_PATH: "POST",
        SCHEMA_PATH: "GET",
    }
    install_log_filters()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        with limit_repeats(RepeatLimiter()):
            _ = state.upstream.client
            if settings.warmup:
                state.optimizer_state = "loading"
                state.pool.submit_background(lambda: _warm_up(state))
            try:
                yield
            finally:
                await state.aclose()

    async def optimized(request: Request) -> Response:
        route, flow = flows[request.scope["path"]]
        return await _guarded(state, request, route, lambda raw: flow.handle(request, raw))

    async def compress(request: Request) -> Response:
        return await _guarded(state, request, "compress", lambda raw: compressor.handle(request, raw))

    async def compress_schema_route(request: Request) -> Response:
        return JSONResponse(compress_schema())

    async def stats(request: Request) -> Response:  # built off the event loop
        return Response(await anyio.to_thread.run_sync(state.metrics.stats_json), media_type="application/json")

    async def passthrough(request: Request) -> Response:
        """An optimized Gemini route, a 405 for another method on a local route, or forwarded unchanged (to
        --gemini-upstream on the Gemini API's paths, its errors in Google's shape; else to --upstream)."""
        path = request.scope["path"]
        label = gemini_route(path)
        if label is not None and request.method == "POST":
            return await _guarded(state, request, label, lambda raw: gemini.handle(request, raw))
        if path in local_methods or label is not None:  # another method: never forwarded unvalidated
            state.metrics.local_error("invalid_request")
            allow = local_methods.get(path, "POST")
            return error_response(
                405,
                f"{path} takes {allow} requests only",
                "invalid_request_error",
                "method_not_allowed",
                headers={"allow": allow},
                fmt=error_format(path),
            )
        return await _guarded(state, request, "passthrough", lambda raw: state.upstream.forward(request, raw, []))

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok", "optimizer": state.optimizer_state, "mode": state.mode})

    async def livez(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        ready = state.ready
        body = {"status": "ok" if ready else "starting", "optimizer": state.optimizer_state, "mode": state.mode}
        return JSONResponse(body, 200 if ready else 503)

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    routes = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/livez", livez, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/health", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
        *(Route(path, optimized, methods=["POST"]) for path in OPTIMIZED_PATHS),
        Route(COMPRESS_PATH, compress, methods=["POST"]),
        Route(SCHEMA_PATH, compress_schema_route, methods=["GET"]),
        Route("/v1/{path:path}", passthrough, methods=_METHODS),
        Route(GEMINI_PREFIX + "/{path:path}", passthrough, methods=_METHODS),
    ]
    key = settings.api_key.get_secret_value() if settings.api_key is not None else None
    guard = Middleware(
        Guard,
        api_key=key,
        max_body_bytes=settings.max_body_bytes,
        metrics=state.metrics,
        secrets=state.secrets,
        hosts=HostPolicy.build(settings.host, settings.allowed_hosts),
    )
    app = _ProxyApp(
        routes=routes,
        middleware=[guard],
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )
    app.router.redirect_slashes = False  # a redirect would be built from the client's Host header
    app.state.ragopt = state
    return app
