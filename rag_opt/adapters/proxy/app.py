"""The OpenAI-compatible proxy as an ASGI app (Starlette): ``create_app(settings, optimizer=None)``.

``POST /v1/chat/completions`` has its context optimized (see :mod:`rag_opt.adapters.proxy.context`) and is
forwarded; every other ``/v1/...`` request is forwarded unchanged; ``GET /healthz`` and ``GET /metrics``
answer locally. Upstream responses (status, headers, body bytes) are relayed as they arrive, so streamed
server-sent events reach the client chunk by chunk. Optimization runs on a bounded thread pool, never on the
event loop; when it fails or exceeds the time budget the request is forwarded as it came (fail-open).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from rag_opt.adapters.proxy.context import ContextPlan, RequestError, plan_request
from rag_opt.adapters.proxy.metrics import CONTENT_TYPE, Metrics
from rag_opt.adapters.proxy.settings import ProxySettings

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.types import OptimizeResult

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
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
_WARMUP_QUERY = "What does the proxy load at start-up?"
_WARMUP_DOCS = ["The proxy loads its model at start-up. Then the first request is fast. Nothing else happens."]


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
    status: int, message: str, type_: str, code: str | None = None, param: str | None = None
) -> JSONResponse:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status)


@dataclass
class Outcome:
    """What rag-opt did with one chat request; becomes the ``x-ragopt-*`` response headers."""

    status: str
    tokens_before: int = 0
    tokens_after: int = 0
    optimizer_ms: float = 0.0

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [
            (b"x-ragopt-status", self.status.replace("_", "-").encode()),
            (b"x-ragopt-tokens-before", str(self.tokens_before).encode()),
            (b"x-ragopt-tokens-after", str(self.tokens_after).encode()),
            (b"x-ragopt-optimizer-ms", f"{self.optimizer_ms:.1f}".encode()),
        ]


def _connection_listed(values: list[str]) -> set[str]:
    return {t.strip().lower() for v in values for t in v.split(",") if t.strip()}


class _Relay(Response):
    """Relays an upstream response: status, headers and the raw body bytes as they arrive.

    A client disconnect closes the upstream response. An upstream failure after the headers were sent leaves
    the response incomplete, so the server closes the connection and the client sees a broken stream (not a
    clean, truncated one).
    """

    def __init__(self, upstream: httpx.Response, headers: list[tuple[bytes, bytes]], metrics: Metrics) -> None:
        self.status_code = upstream.status_code
        self.raw_headers = headers
        self.background = None
        self._upstream = upstream
        self._metrics = metrics

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

    async def _relay(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self._upstream.aiter_raw():
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            self._metrics.upstream_error("stream")
            logger.warning("upstream response broke off (%s); closing the client connection", type(exc).__name__)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class ProxyState:
    """Everything one proxy app holds: settings, optimizer, metrics, the upstream client and the thread pool."""

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
            )
        self.optimizer: Optimizer = optimizer
        self.metrics = Metrics()
        # threads start on first use; queued work counts against each request's time budget
        self.executor = ThreadPoolExecutor(max_workers=settings.max_concurrency, thread_name_prefix="rag-opt")
        self._client: httpx.AsyncClient | None = None
        self.optimizer_state = "cold"

    # -- lifecycle ----------------------------------------------------------------------------------------
    @property
    def client(self) -> httpx.AsyncClient:
        """The one shared upstream client (created on first use, closed at shutdown)."""
        if self._client is None:
            s = self.settings
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(s.read_timeout, connect=s.connect_timeout, pool=s.connect_timeout),
                limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100),
                follow_redirects=False,
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        self.executor.shutdown(wait=False, cancel_futures=True)

    def warm_up(self) -> None:
        """Load the proxy model (runs on the thread pool at start-up; requests meanwhile wait or fail open)."""
        self.optimizer_state = "loading"
        try:
            self.optimizer.optimize(_WARMUP_QUERY, _WARMUP_DOCS, ratio=0.5)
        except Exception as exc:  # the proxy still serves: requests fail open
            self.optimizer_state = "failed"
            logger.warning("optimizer warm-up failed (%s: %s); requests will fail open", type(exc).__name__, exc)
        else:
            self.optimizer_state = "ready"
            logger.info("optimizer ready")

    # -- chat completions ---------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        self.metrics.request("chat_completions")
        raw = await request.body()
        prepared = await self._prepare(raw, request)
        if isinstance(prepared, Response):
            return prepared
        body, outcome = prepared
        self.metrics.outcome(outcome.status)
        return await self.forward(request, body, outcome.headers())

    async def _prepare(self, raw: bytes, request: Request) -> tuple[bytes, Outcome] | Response:
        s = self.settings
        try:
            plan = plan_request(
                raw, request.headers, tag=s.document_tag, tool_messages=s.tool_messages, tool_min_chars=s.tool_min_chars
            )
        except RequestError as exc:
            self.metrics.outcome("rejected")
            return error_response(400, exc.message, "invalid_request_error", exc.code, exc.param)
        except Exception as exc:  # a bug here must not reach the client
            logger.warning("finding context failed (%s); forwarding the request unchanged", type(exc).__name__)
            logger.debug("finding context failed", exc_info=True)
            self.metrics.failed_open("error")
            return raw, Outcome("fail_open")
        if plan is None:
            return raw, Outcome("no_context")
        if not plan.options.enabled:
            return self._render(plan, None), Outcome("disabled")
        if not plan.documents:
            return self._render(plan, None), Outcome("no_context")
        if plan.query is None:
            return self._render(plan, None), Outcome("no_query")
        t0 = time.perf_counter()
        result, reason = await self._optimize(plan)
        ms = (time.perf_counter() - t0) * 1e3
        if result is not None:
            try:
                body = plan.render(result)
            except Exception as exc:
                logger.warning("writing the optimized context back failed (%s); forwarding unchanged", exc)
                result, reason = None, "error"
        if result is None:
            self.metrics.failed_open(reason)
            return self._render(plan, None), Outcome("fail_open", optimizer_ms=ms)
        self.metrics.optimization(
            ms / 1e3, result.tokens_before, result.tokens_after, len(plan.documents), len(result.documents)
        )
        return body, Outcome("optimized", result.tokens_before, result.tokens_after, ms)

    def _render(self, plan: ContextPlan, result: OptimizeResult | None) -> bytes:
        try:
            return plan.render(result)
        except Exception as exc:  # pragma: no cover - last resort: the original bytes
            logger.warning("rewriting the request failed (%s); forwarding the original bytes", exc)
            return plan.raw

    async def _optimize(self, plan: ContextPlan) -> tuple[OptimizeResult | None, str]:
        """Run the optimizer on the thread pool within the time budget; (None, reason) when it fails."""
        budget = plan.options.budget(self.settings.budget)
        ordering = plan.options.ordering or self.settings.ordering
        query, docs, optimizer = plan.query or "", plan.optimizer_documents(), self.optimizer

        def job() -> OptimizeResult:
            return optimizer.optimize(query, docs, ordering=ordering, **budget)

        loop = asyncio.get_running_loop()
        self.metrics.in_flight += 1
        try:
            future = loop.run_in_executor(self.executor, job)
            return await asyncio.wait_for(future, timeout=self.settings.time_budget_ms / 1e3), ""
        except TimeoutError:
            logger.warning(
                "optimization exceeded the %.0f ms time budget; forwarding the request unchanged",
                self.settings.time_budget_ms,
            )
            return None, "timeout"
        except Exception as exc:
            logger.warning("optimization failed (%s: %s); forwarding the request unchanged", type(exc).__name__, exc)
            logger.debug("optimization failed", exc_info=True)
            return None, "error"
        finally:
            self.metrics.in_flight -= 1

    # -- forwarding ---------------------------------------------------------------------------------------
    async def passthrough(self, request: Request) -> Response:
        self.metrics.request("passthrough")
        return await self.forward(request, await request.body(), [])

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
        """Send the request upstream and relay the response as it arrives."""
        headers = self._request_headers(request)
        sent = {k.decode("latin-1").lower() for k, _ in headers}
        req = self.client.build_request(
            request.method, self._upstream_url(request.scope), headers=headers, content=body or None
        )
        for name in _HTTPX_DEFAULTS:
            if name not in sent and name in req.headers:
                del req.headers[name]
        try:
            upstream = await self.client.send(req, stream=True)
        except httpx.TimeoutException as exc:
            self.metrics.upstream_error("timeout")
            logger.warning("upstream timed out (%s)", type(exc).__name__)
            return error_response(
                504, "the upstream LLM server did not answer in time", "upstream_error", "upstream_timeout"
            )
        except httpx.HTTPError as exc:
            self.metrics.upstream_error("connect")
            logger.warning("upstream unreachable (%s: %s)", type(exc).__name__, exc)
            return error_response(
                502, "could not reach the upstream LLM server", "upstream_error", "upstream_unavailable"
            )
        self.metrics.upstream_response(upstream.status_code)
        drop = HOP_BY_HOP | _connection_listed(upstream.headers.get_list("connection"))
        out = [(k.lower(), v) for k, v in upstream.headers.raw if k.decode("latin-1").lower() not in drop]
        return _Relay(upstream, out + extra_headers, self.metrics)

    # -- local endpoints ----------------------------------------------------------------------------------
    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "optimizer": self.optimizer_state})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        msg = f"unknown path {request.url.path}: rag-opt serves /v1/..., /healthz and /metrics"
        return error_response(404, msg, "invalid_request_error", "not_found")
    return error_response(exc.status_code, str(exc.detail), "invalid_request_error", None)


async def _server_error(request: Request, exc: Exception) -> Response:
    logger.error("unexpected error (%s)", type(exc).__name__, exc_info=exc)
    return error_response(500, "internal error in the rag-opt proxy", "server_error", None)


def create_app(settings: ProxySettings, optimizer: Optimizer | None = None) -> Starlette:
    """The proxy app. ``optimizer``: anything with ``ContextOptimizer.optimize``'s signature (default: a
    ``ContextOptimizer`` built from ``settings``; the model loads at start-up when ``settings.warmup``).

    ``app.state.ragopt`` is the :class:`ProxyState` (metrics, optimizer, settings).
    """
    state = ProxyState(settings, optimizer)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        _ = state.client
        if settings.warmup:
            state.executor.submit(state.warm_up)
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
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )
    app.state.ragopt = state
    return app
